"""The two-pass norm pass holds the operands of the last layers it normed at once (within
``HELD_LOWEST`` output-gradient elements) and releases them from these operands: a layer whose
operand changed after its norm gets its certified term again, as under book-keeping; the layers
held are those normed last."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from private_engine.capture.recorder import RecordedLayer
from private_engine.clipping import release
from private_engine.clipping.fingerprints import fingerprint_pairs
from private_engine.layers.linear import LinearRule


def _normed(strategy: release.TwoPass, d_in: int, d_out: int, seed: int):
    """A Linear normed at once by ``strategy`` (held if there is room): its layer record."""
    torch.manual_seed(seed)
    module, rule = nn.Linear(d_in, d_out), LinearRule()
    pairs = [(torch.randn(3, 4, d_in), torch.randn(3, 4, d_out))]
    layer = RecordedLayer(f"l{seed}", module, rule)
    first = release.FirstPass(True, 1, fingerprint_pairs(pairs),
                              rule.certified_norm_sq(module, pairs, True))
    strategy.first[id(layer)] = first
    strategy._hold(layer, pairs, first)
    return layer, pairs


def _done(strategy: release.TwoPass) -> list:
    """End the pass: the kept ``(module, rule, pairs)``."""
    kept: list = []
    clipper = SimpleNamespace(keep_pairs=lambda *k: kept.append(k),
                              recorder=SimpleNamespace(extras=[]))
    strategy.norm_pass_done(clipper, [], True)
    return kept


@pytest.mark.parametrize("which", ["a", "g"])
def test_a_held_operand_changed_after_its_norm_gets_its_term_again(which):
    """One element of the second layer's activation or output gradient scaled by 10⁶ after its
    norm (a ``.data`` write from a later hook): that layer's certified norm is formed again from
    the operands as they are now — those its clipped sum is formed from — and only that
    layer's; both layers are then released from their held operands, not by the second pass."""
    strategy = release.TwoPass("ghost")
    strategy.start()
    first, _ = _normed(strategy, 6, 4, 0)
    layer, pairs = _normed(strategy, 5, 7, 1)
    a, g = pairs[0]
    (a if which == "a" else g).data[1, 2, 3] *= 1e6
    terms = strategy.changed_terms()
    assert len(terms) == 1
    assert torch.equal(terms[0], layer.rule.certified_norm_sq(layer.module, pairs, True))
    a64, g64 = a.double(), g.double()
    exact = (torch.einsum("ntp,ntd->npd", g64, a64).pow(2).sum((1, 2))
             + g64.sum(1).pow(2).sum(1))
    assert bool((terms[0] >= exact).all())
    kept = _done(strategy)
    assert [k[0] for k in kept] == [first.module, layer.module]
    assert strategy.second_pass_layers([first, layer]) == []


def test_the_layers_held_are_the_last_normed_within_the_limit(monkeypatch):
    """Room for 2·48 output-gradient elements: of three layers of 48, 48 and 84 normed in this
    order, the last alone is held (the first two dropped as it came); the layers not held stay
    with the second pass, unchanged operands add no term."""
    monkeypatch.setattr(release, "HELD_LOWEST", 2 * 48)
    strategy = release.TwoPass("ghost")
    strategy.start()
    layers = [_normed(strategy, 6, 4, 0)[0], _normed(strategy, 6, 4, 1)[0]]
    assert [h.layer for h in strategy._held] == layers
    layers.append(_normed(strategy, 5, 7, 2)[0])
    assert [h.layer for h in strategy._held] == layers[2:]
    assert strategy.changed_terms() == []
    assert [k[0] for k in _done(strategy)] == [layers[2].module]
    assert strategy.second_pass_layers(layers) == layers[:2]
