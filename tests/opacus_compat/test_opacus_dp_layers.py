"""Opacus' DP layers (DPLSTM, DPGRU, DPRNN, DPMultiheadAttention and its SequenceBias) with the
Opacus-compatible engine: the same parameters and ε as Opacus with sum reduction and with
``batch_first=False``, exact against the float64 one-sample-at-a-time reference through the native
API too, and clear refusals (packed sequences; SequenceBias outside ``make_private``)."""
from __future__ import annotations

import pytest
import torch
from compat_cases import MODELS, TextLSTM, TinyMHA, assert_same_run, data_for, make_compat
from torch import nn

import private_engine as pe

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn", "mha"])
def test_opacus_dp_layers_sum_reduction(name):
    assert_same_run(name, mode="hooks", reduction="sum", noise=0.5)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_first_false(mode, reduction):
    assert_same_run("seq_first", mode=mode, reduction=reduction, batch_first=False)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_sequence_bias_add_bias_kv(mode):
    assert_same_run("seq_first_bias_kv", mode=mode, batch_first=False)


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn", "mha"])
@pytest.mark.parametrize("mode", ["mixed", "ghost", "per_sample"])
def test_native_engine_with_opacus_dp_layers(name, mode):
    """Opacus' DP layers through the native API (``PrivacyEngine(model, ...)``) against the
    reference."""
    from engine_checks import check_against_reference
    torch.manual_seed(0)
    model = MODELS[name]().double()
    # softmax is shift-invariant: the key bias has an exactly zero gradient (relative error
    # undefined)
    if name == "mha":
        model.attn.klinear.bias.requires_grad_(False)
    x, y = data_for(name, n=5)
    check_against_reference(model, [x, y],
                            lambda m, xi, yi: nn.functional.cross_entropy(m(xi), yi,
                                                                          reduction="none"),
                            mode=mode, clip="abadi")


def test_packed_sequence_is_rejected_clearly():
    model = TextLSTM().double()
    module, _, _ = make_compat(model)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 4, 6, dtype=torch.float64), [4, 2, 1],
                                               batch_first=True)
    with pytest.raises(TypeError, match="pad_packed_sequence"):
        model.lstm(packed)


def test_make_private_leaves_no_mark_on_sequence_bias():
    """The mark that lets SequenceBiasRule accept a module exists during make_private's check only:
    the native engine (which does not move SequenceBias' tensors to batch-first) still refuses the
    model afterwards."""
    from opacus.layers.dp_multihead_attention import SequenceBias

    from private_engine.opacus_compat.sequence_bias import PREPARED

    model = TinyMHA(add_bias_kv=True).double()
    biases = [m for m in model.modules() if isinstance(m, SequenceBias)]
    with pytest.raises(ValueError, match="batch_first"):  # fails after the layer validation
        make_compat(model, batch_first=False)
    assert biases and not any(hasattr(m, PREPARED) for m in biases)
    module, _, _ = make_compat(model)
    assert not any(hasattr(m, PREPARED) for m in biases)
    module.remove_hooks()
    with pytest.raises(ValueError, match="Opacus-compatible API only"):
        pe.PrivacyEngine(model, batch_size=2, sample_size=4, max_grad_norm=1.0,
                         noise_multiplier=1.0)
