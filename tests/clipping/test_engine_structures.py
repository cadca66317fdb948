"""Model structures: frozen weight with trainable bias, a layer called twice in one forward,
in-place ReLU right after a layer, inputs that require grad, calls that do not reach the loss."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_checks import (
    CLIPS,
    MODES,
    check_against_reference,
    gen_for,
    make_engine,
    quadratic_loss,
    target_like,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(model, shape, seed=0):
    gen = gen_for(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return [x, target_like(model, x, gen)]


# -- frozen parameters ------------------------------------------------------------------------
def _frozen_models():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    lin[0].weight.requires_grad_(False)  # frozen weight, trainable bias (first layer)
    lin[2].bias.requires_grad_(False)  # trainable weight, frozen bias
    conv = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(3, 2, 2, groups=1)).double()
    conv[0].weight.requires_grad_(False)
    conv[2].bias.requires_grad_(False)
    norm = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Conv1d(2, 4, 1),
                         nn.GroupNorm(2, 4)).double()
    norm[1].weight.requires_grad_(False)
    norm[3].bias.requires_grad_(False)
    norm[0].requires_grad_(False)  # a fully frozen first layer
    only_bias = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    only_bias[0].weight.requires_grad_(False)
    only_bias[2].requires_grad_(False)  # the last layer entirely frozen
    return {"linear": (lin, (5, 6, 4)), "conv": (conv, (4, 2, 5, 5)), "norm": (norm, (4, 2, 3)),
            "only_bias": (only_bias, (5, 4))}


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["linear", "conv", "norm", "only_bias"])
def test_frozen_weight_trainable_bias(case, mode, clip):
    model, shape = _frozen_models()[case]
    engine = check_against_reference(model, _inputs(model, shape), mode=mode, clip=clip)
    assert [p for p in engine.params] == [p for p in model.parameters() if p.requires_grad]


# -- a layer called several times in one forward (weight sharing across calls) ----------------
class LinearTwice(nn.Module):
    """The same Linear on a 3-D input and then on a 2-D summary: calls of different
    ranks/lengths."""

    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))  # (B, T, d)
        s = self.lin(h.mean(1))  # (B, d): second call on the first call's output
        return self.out(torch.tanh(s) + h.sum(1))


class ConvTwice(nn.Module):
    """The same Conv2d at two resolutions (T differs between calls)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1, stride=2)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        h = self.conv(h)
        return self.head(h.mean((2, 3)))


class EmbeddingTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 3, padding_idx=0)
        self.out = nn.Linear(3, 2)

    def forward(self, ids):
        a = self.emb(ids)  # (B, T, 3)
        b = self.emb(ids.flip(1)[:, :2])  # a second lookup on other tokens
        return self.out(a.sum(1) * b.mean(1))


class NormsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.ln = nn.LayerNorm(4)
        self.gn = nn.GroupNorm(2, 4)

    def forward(self, x):  # x: (B, T, 3)
        h = self.ln(self.lin(x))
        h = self.ln(torch.tanh(h) * 2 + 1)
        g = self.gn(h.transpose(1, 2))
        return self.gn(torch.sin(g))


def _twice_case(name):
    torch.manual_seed(1)
    if name == "linear":
        model = LinearTwice().double()
        return model, _inputs(model, (4, 5, 4))
    if name == "conv":
        model = ConvTwice().double()
        return model, _inputs(model, (3, 3, 7, 6))
    if name == "embedding":
        model = EmbeddingTwice().double()
        gen = gen_for(2)
        ids = torch.randint(0, 6, (5, 4), generator=gen)
        return model, [ids, target_like(model, ids, gen)]
    model = NormsTwice().double()
    return model, _inputs(model, (4, 5, 3))


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["linear", "conv", "embedding", "norms"])
def test_layer_called_twice(case, mode, clip):
    """Per-sample gradient of a shared layer is Σ_calls G_i^c: its norm has cross terms."""
    model, inputs = _twice_case(case)
    engine = check_against_reference(model, inputs, mode=mode, clip=clip)
    calls = {d.name: d.calls for d in engine.layer_plan}
    shared = {"linear": "lin", "conv": "conv", "embedding": "emb", "norms": "ln"}[case]
    assert calls[shared] == 2


def test_called_twice_is_not_sum_of_separate_norms():
    """Guard against norming calls one by one: the cross term must be there."""
    torch.manual_seed(0)
    model = LinearTwice().double()
    inputs = _inputs(model, (4, 5, 4))
    engine = make_engine(model, 4, R=1e9)
    engine.clipped_grad_sum(quadratic_loss(model, *inputs))
    from reference import reference_clipped_sum
    _, ref_norms = reference_clipped_sum(model, inputs, quadratic_loss, 1e9,
                                         lambda n, R: torch.ones_like(n))
    torch.testing.assert_close(engine.last_norms, ref_norms, rtol=1e-12, atol=0)


# -- in-place activations right after a clipped layer --------------------------------------------
def _inplace_case(name):
    torch.manual_seed(3)
    if name == "linear3d":
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3),
                              nn.ReLU(inplace=True), nn.Linear(3, 2))
        shape = (5, 7, 4)
    elif name == "linear4d":
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))
        shape = (4, 2, 3, 3)
    elif name == "linear2d":
        model = nn.Sequential(nn.Linear(3, 5), nn.LeakyReLU(0.1, inplace=True), nn.Linear(5, 2))
        shape = (4, 3)
    elif name == "conv":
        model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(inplace=True),
                              nn.Conv2d(4, 3, 2, stride=2), nn.ReLU(inplace=True), nn.Flatten(),
                              nn.LazyLinear(2))
        shape = (4, 2, 7, 7)
    else:  # conv1d then an in-place add on the output
        model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Hardtanh(-0.5, 0.5, inplace=True),
                              nn.Conv1d(3, 2, 1))
        shape = (4, 2, 6)
    model(torch.zeros(shape))  # materialise lazy layers
    model = model.double()
    return model, _inputs(model, shape)


@pytest.mark.parametrize("clip", ["abadi", "global"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["linear3d", "linear4d", "linear2d", "conv", "conv1d_hardtanh"])
def test_inplace_activation_after_layer(case, mode, clip):
    model, inputs = _inplace_case(case)
    check_against_reference(model, inputs, mode=mode, clip=clip)


# -- inputs that require grad; calls whose output does not reach the loss ----------------------
@pytest.mark.parametrize("mode", MODES)
def test_input_requiring_grad(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, t = _inputs(model, (5, 3))
    x.requires_grad_(True)
    check_against_reference(model, [x, t], mode=mode, clip="abadi")


class DeadBranch(nn.Module):
    """One call of a layer feeds the loss, another call's output is thrown away; a layer
    whose only call is thrown away contributes nothing."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        _ = self.a(h)  # discarded call
        _ = self.unused(h)
        return self.out(h)


@pytest.mark.parametrize("mode", MODES)
def test_calls_not_reaching_the_loss(mode):
    torch.manual_seed(0)
    model = DeadBranch().double()
    check_against_reference(model, _inputs(model, (4, 3)), mode=mode, clip="abadi")


@pytest.mark.parametrize("mode", MODES)
def test_modes_agree_on_a_mixed_model(mode):
    """Conv → GroupNorm → Linear(4-D) → LayerNorm plus an Embedding branch, cross-entropy loss."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding="same", padding_mode="circular")
            self.gn = nn.GroupNorm(2, 4)
            self.proj = nn.Linear(4, 5)
            self.ln = nn.LayerNorm(5)
            self.emb = nn.Embedding(7, 5)
            self.head = nn.Linear(5, 3)

        def forward(self, x, ids):
            h = F.gelu(self.gn(self.conv(x)))
            h = self.ln(self.proj(h.permute(0, 2, 3, 1)))  # (B, H, W, 5)
            h = h.mean((1, 2)) + self.emb(ids).mean(1)
            return self.head(h)

    torch.manual_seed(0)
    model = Net().double()
    gen = gen_for(0)
    x = torch.randn(6, 3, 5, 4, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 7, (6, 3), generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    loss_fn = lambda m, x, ids, y: F.cross_entropy(m(x, ids), y, reduction="none")  # noqa: E731
    results = {}
    for clip in CLIPS:
        engine = check_against_reference(model, [x, ids, y], loss_fn, mode=mode, clip=clip)
        results[clip] = engine.last_norms
    # norms do not depend on the clip function
    for clip in CLIPS[1:]:
        torch.testing.assert_close(results[clip], results["abadi"], rtol=1e-12, atol=0)


def test_modes_give_identical_sums():
    """Mixed, ghost and per_sample on the same batch: same norms and clipped sums (to 1e-12)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, groups=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, groups=8), nn.GroupNorm(4, 8), nn.Flatten(2),
                          nn.Linear(4, 6), nn.LayerNorm(6), nn.Flatten(), nn.Linear(48, 3)).double()
    x, t = _inputs(model, (5, 3, 9, 9))
    out = {}
    for mode in MODES:
        engine = make_engine(model, 5, mode=mode, R=0.5)
        grads, _ = engine.clipped_grad_sum(quadratic_loss(model, x, t))
        out[mode] = (grads, engine.last_norms, engine.layer_plan)
        engine.detach()
    assert (any(d.use_ghost for d in out["mixed"][2])
            and not all(d.use_ghost for d in out["mixed"][2] if d.ghost_capable))
    for mode in ("ghost", "per_sample"):
        torch.testing.assert_close(out[mode][1], out["mixed"][1], rtol=1e-12, atol=0)
        for a, b in zip(out[mode][0], out["mixed"][0]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


# -- layouts and sizes -----------------------------------------------------------------------------
class TransposedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):  # (B, 4, T) -> Linear on a non-contiguous (B, T, 4) view
        return self.lin(x.transpose(1, 2))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["batch_of_one", "channels_last", "non_contiguous"])
def test_layouts_and_batch_of_one(case, mode):
    torch.manual_seed(0)
    if case == "batch_of_one":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(),
                              nn.Linear(64, 3)).double()
        inputs = _inputs(model, (1, 3, 6, 6))
        # R below the only norm
        check_against_reference(model, inputs, mode=mode, clip="abadi", R=0.01)
        return
    if case == "channels_last":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                              nn.Conv2d(8, 4, 3, stride=2, groups=4))
        model = model.double().to(memory_format=torch.channels_last)
        x, t = _inputs(model, (3, 3, 7, 7))
        inputs = [x.to(memory_format=torch.channels_last), t]
    else:
        model = TransposedInput().double()
        inputs = _inputs(model, (4, 4, 5))
    check_against_reference(model, inputs, mode=mode, clip="abadi")
