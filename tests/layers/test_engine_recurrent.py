"""nn.LSTM / nn.GRU / nn.RNN: refused before training, naming the module and the fix;
``fix_recurrent`` swaps them for Opacus' DPLSTM / DPGRU / DPRNN computing the same function (same
outputs, parameter names and values), which every mode clips exactly (float64 reference)."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from engine_checks import MODES, check_against_reference, gen_for

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:these modules are clipped"),
              pytest.mark.filterwarnings("ignore:Secure RNG turned off")]

RECURRENT = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class Seq(nn.Module):
    """A recurrent layer whose output sequence and final hidden state both enter the output;
    batch-first input, handed to a sequence-first layer transposed."""

    def __init__(self, kind: str, batch_first: bool = True, **kwargs):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = RECURRENT[kind](3, 4, batch_first=batch_first, **kwargs)
        self.head = nn.Linear(4 * (2 if kwargs.get("bidirectional") else 1), 2)

    def forward(self, x):
        out, h = self.rnn(x if self.batch_first else x.transpose(0, 1))
        h = h[0] if isinstance(h, tuple) else h  # LSTM: (h_n, c_n)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out).sum(1) + h.transpose(0, 1).sum((1, 2))[:, None]


def _input(seed: int = 0, B: int = 4, T: int = 3) -> torch.Tensor:
    return torch.randn(B, T, 3, generator=gen_for(seed), dtype=torch.float64)


@pytest.mark.parametrize("kind", list(RECURRENT))
def test_torch_recurrent_layers_are_refused_naming_the_fix(kind):
    model = Seq(kind)
    with pytest.raises(ValueError, match=r"recurrent layers \(rnn\).*fix_recurrent"):
        pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                         noise_multiplier=0.0)
    from private_engine import opacus_compat

    loader = DataLoader(TensorDataset(torch.zeros(8, 3)), batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # the door validates as Opacus does first: Opacus refuses nn.LSTM and nn.GRU itself (and its
    # ModuleValidator.fix replaces them); nn.RNN reaches the engine's own refusal
    with pytest.raises(ValueError, match=r"fix_recurrent" if kind == "rnn" else
                       "drop-in replacement"):
        opacus_compat.PrivacyEngine().make_private(module=model, optimizer=opt,
                                                   data_loader=loader, noise_multiplier=0.0,
                                                   max_grad_norm=1.0)


VARIANTS = [dict(), dict(num_layers=2, bidirectional=True), dict(bias=False),
            dict(batch_first=False, num_layers=2)]


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("kind", list(RECURRENT))
def test_fix_recurrent_computes_the_same_function(kind, variant):
    kwargs = dict(VARIANTS[variant])
    if kind == "rnn" and variant == 2:
        kwargs["nonlinearity"] = "relu"
    torch.manual_seed(variant)
    model = Seq(kind, **kwargs).double()
    model.rnn.weight_hh_l0.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    x = _input()
    with torch.no_grad():
        want = model(x)
    fixed = pe.fix_recurrent(model)
    assert fixed is model and type(model.rnn).__name__ == "DP" + type(model.rnn).__name__[2:]
    assert type(model.rnn).__name__ in ("DPLSTM", "DPGRU", "DPRNN")
    new_state = model.state_dict()  # nn.LSTM's keys (Opacus adds its cells' own names)
    assert all(torch.equal(new_state[k], v) for k, v in state.items())
    # the very tensors (an optimizer built before keeps them), under the same names
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is p for n, p in params.items())
    assert not dict(model.named_parameters())["rnn.weight_hh_l0"].requires_grad
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)


def test_fix_recurrent_refuses_projections():
    with pytest.raises(ValueError, match="proj_size"):
        pe.fix_recurrent(nn.Sequential(nn.LSTM(3, 4, proj_size=2)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(RECURRENT))
def test_fixed_recurrent_layers_match_reference(kind, mode):
    # half the modes see a two-layer batch-first layer, the other half a sequence-first
    # bidirectional one
    batch_first = MODES.index(mode) % 2 == 0
    kwargs = dict(num_layers=2) if batch_first else dict(bidirectional=True)
    torch.manual_seed(1)
    model = pe.fix_recurrent(Seq(kind, batch_first=batch_first, **kwargs)).double()
    x = _input(seed=1)
    with torch.no_grad():
        t = torch.randn(model(x).shape, generator=gen_for(2), dtype=torch.float64)
    for clip in ("abadi", "custom"):
        check_against_reference(model, [x, t], mode=mode, clip=clip)
