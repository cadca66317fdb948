"""layer_plan / format_plan: T, D, p, ghost_cost = 2T², instantiate_cost = pD, and eq. (4.1)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import MODES, make_engine
from private_engine.clipping.plan import INSTANTIATED_ELEMENT_COST

pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.big_image = nn.Conv2d(3, 4, 3, padding=1)  # T = 16·16 = 256: 2T² = 131072 > pD = 4·27
        self.small_image = nn.Conv2d(4, 64, 3, stride=4)  # T = 4·4 = 16: 2T² = 512 < pD = 64·36
        self.depthwise = nn.Conv2d(64, 64, 3, padding=1, groups=64)  # 2T²·groups = 32768 > pD = 576
        self.gn = nn.GroupNorm(8, 64)
        self.proj = nn.Linear(64, 32)  # on (B, 4, 4, 64): T = 16, 2T² = 512 < 2048
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)  # T = 1
        self.emb = nn.Embedding(50, 10)

    def forward(self, x, ids):
        h = F.relu(self.big_image(x))
        h = self.gn(self.depthwise(self.small_image(h)))
        h = self.ln(self.proj(h.permute(0, 2, 3, 1)))
        return self.head(h.mean((1, 2))) + self.emb(ids).mean(1)


def _inputs(size=16, B=2):
    return torch.randn(B, 3, size, size), torch.randint(0, 50, (B, 7))


EXPECTED_DIMS = {  # name: (T, D, p, groups)
    "big_image": (256, 27, 4, 1),
    "small_image": (16, 36, 64, 1),
    "depthwise": (16, 9, 64, 64),
    "gn": (16, 1, 64, 1),
    "proj": (16, 64, 32, 1),
    "ln": (16, 1, 32, 1),
    "head": (1, 32, 10, 1),
    "emb": (7, 50, 10, 1),
}


def _io_per_sample(module, model):
    """Elements per sample of the module's input and output in one forward of ``_inputs()``,
    measured by a hook."""
    seen = []
    h = module.register_forward_hook(lambda m, i, o: seen.append((i[0][0].numel() + o[0].numel())))
    try:
        with torch.no_grad():
            model(*_inputs())
    finally:
        h.remove()
    return sum(seen)


@pytest.mark.parametrize("mode", MODES)
def test_layer_plan_rows(mode):
    torch.manual_seed(0)
    model = Net()
    before = [p.detach().clone() for p in model.parameters()]
    plan = pe.layer_plan(model, _inputs(), mode=mode)
    assert all(isinstance(d, pe.LayerDecision) for d in plan)
    rows = {d.name: d for d in plan}
    assert set(rows) == set(EXPECTED_DIMS)
    for name, (T, D, p, groups) in EXPECTED_DIMS.items():
        d = rows[name]
        assert (d.T, d.D, d.p, d.groups) == (T, D, p, groups), d
        assert d.ghost_cost == 2 * T * T * groups
        assert d.instantiate_cost == p * D
        assert d.layer_type == type(getattr(model, name)).__name__
        if not d.ghost_capable:
            assert not d.use_ghost
        elif mode == "mixed":  # seed 002's memory rule
            assert d.use_ghost == (d.ghost_cost < d.instantiate_cost)
        # instantiate when G_i (p·D) is no larger than what a ghost layer keeps, (a, g)
        elif mode == "bk_mixed":
            module = getattr(model, name)
            io = _io_per_sample(module, model)
            assert d.io_size == io, (name, d.io_size, io)
            assert d.use_ghost == (p * D > io and d.ghost_cost < d.instantiate_cost), d
        # book-keeping's time rule: float64 Grams 2·T²·(groups·D' + p) against the memory
        # traffic of G_i, κ·p·D (D' = 1 for Embedding)
        elif mode == "bk_mixopt":
            gram_d = 1 if name == "emb" else D
            kappa = INSTANTIATED_ELEMENT_COST
            assert d.use_ghost == (2 * T * T * (groups * gram_d + p) < kappa * p * D), d
        else:
            assert d.use_ghost == (mode in ("ghost", "bk"))
    assert not rows["gn"].ghost_capable and not rows["ln"].ghost_capable
    if mode == "mixed":  # eq. (4.1) on the convs
        assert (not rows["big_image"].use_ghost and rows["small_image"].use_ghost
                and not rows["depthwise"].use_ghost)
    # no side effects: parameters, grads and hooks untouched
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("trial", range(6))
def test_conv2d_decision_follows_two_T_squared_lt_pD(trial):
    """Random Conv2d shapes: use_ghost ⇔ 2T² < p·D (mixed), with T = H_out·W_out, D = C_in/g·k²."""
    import random
    rng = random.Random(trial)
    cin, cout, k = rng.choice([1, 3, 8, 32]), rng.choice([2, 16, 64, 128]), rng.choice([1, 3, 5])
    stride, size = rng.choice([1, 2, 4]), rng.choice([6, 12, 24])
    conv = nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2)
    (d,) = pe.layer_plan(nn.Sequential(conv), torch.randn(1, cin, size, size), mode="mixed")
    H = (size + 2 * (k // 2) - k) // stride + 1
    T, D = H * H, cin * k * k
    assert (d.T, d.D, d.p) == (T, D, cout)
    assert d.use_ghost == (2 * T * T < cout * D)


def test_engine_decides_per_batch():
    """The decision follows the input shape of each batch (variable resolution)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1))
    engine = make_engine(model, 2)
    for size, ghost in [(2, True), (12, False), (3, True)]:  # pD = 432; 2T² = 32, 41472, 162
        x = torch.randn(2, 3, size, size)
        engine.clipped_grad_sum(model(x).flatten(1).pow(2).sum(1))
        (d,) = engine.layer_plan
        assert d.T == size * size and d.use_ghost == ghost
        assert pe.layer_plan(model, x, mode="mixed") == engine.layer_plan


def test_engine_layer_plan_matches_layer_plan():
    torch.manual_seed(0)
    model = Net()
    x, ids = _inputs()
    engine = make_engine(model, 2)
    engine.clipped_grad_sum(model(x, ids).pow(2).sum(1))
    assert sorted(engine.layer_plan, key=lambda d: d.name) == sorted(pe.layer_plan(model, (x, ids)),
                                                                     key=lambda d: d.name)


def test_layer_called_twice_concatenates_positions():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    (d,) = pe.layer_plan(model, torch.randn(2, 5, 4))
    assert d.calls == 2 and d.T == 10 and d.ghost_cost == 200


def test_format_plan_table_and_totals():
    torch.manual_seed(0)
    plan = pe.layer_plan(Net(), _inputs())
    text = pe.format_plan(plan, title="Net")
    lines = text.splitlines()
    assert lines[0] == "Net"
    header = lines[1].split()
    assert header == ["layer", "type", "T", "D", "p", "2T²", "pD", "choice"]
    for d in plan:
        row = next(line for line in lines if line.split() and line.split()[0] == d.name)
        cells = row.split()
        assert cells[1] == d.layer_type
        assert [int(c.replace(",", "")) for c in (cells[2], cells[3], cells[4], cells[6])] == [
            d.T, d.D, d.p, d.instantiate_cost]
        assert cells[5] == (f"{d.ghost_cost:,}" if d.ghost_capable else "-")
        assert cells[7] == ("ghost" if d.use_ghost else "instantiate")
    ghost_total = sum(d.ghost_cost if d.ghost_capable else d.instantiate_cost for d in plan)
    inst_total = sum(d.instantiate_cost for d in plan)
    mixed_total = sum(d.ghost_cost if d.use_ghost else d.instantiate_cost for d in plan)
    total_line = lines[-1]
    for total in (ghost_total, inst_total, mixed_total):
        assert f"{total:,}" in total_line, total_line
    assert mixed_total <= min(ghost_total, inst_total)
    n_ghost = sum(d.use_ghost for d in plan)
    assert f"{n_ghost} ghost, {len(plan) - n_ghost} instantiate" in total_line
    assert pe.format_plan([])  # an empty plan still prints a table


def test_layer_plan_rejects_unknown_mode():
    with pytest.raises(ValueError, match="clipping_mode"):
        pe.layer_plan(nn.Linear(2, 2), torch.randn(1, 2), mode="fastest")


@pytest.mark.parametrize("d_in,p,ghost",
                         [(8, 4, False), (11, 3, True), (31, 1, False), (3, 11, True)])
def test_decision_at_the_boundary(d_in, p, ghost):
    """T = 4: 2T² = 32 against pD = 32 (tie: instantiate), 33 (ghost), 31 (instantiate), 33
    (ghost)."""
    (d,) = pe.layer_plan(nn.Sequential(nn.Linear(d_in, p)), torch.randn(2, 4, d_in), mode="mixed")
    assert (d.ghost_cost, d.instantiate_cost) == (32, p * d_in)
    assert d.use_ghost is ghost


def test_host_side_caches_keep_decisions_and_dims_exact(monkeypatch):
    """Per-step host work is cached where it is a pure function of shapes: a layer's LayerDims per
    pair of input/output shapes (rule.dims runs once per shape), the decision per (layer, dims,
    mode); a new shape gets new dims and a new decision; `cast` returns the tensor itself when the
    dtype already matches."""
    from private_engine.capture.recorder import LayerRecorder
    from private_engine.clipping.plan import decide
    from private_engine.foundation.dtypes import cast
    from private_engine.layers.linear import LinearRule

    lin = nn.Linear(6, 4)
    calls = []
    real_dims = LinearRule.dims
    monkeypatch.setattr(LinearRule, "dims", lambda self, *a: calls.append(1) or real_dims(self, *a))
    rec = LayerRecorder([("lin", lin, LinearRule())])
    try:
        for T in (3, 3, 5):
            lin(torch.randn(2, T, 6, requires_grad=True))
        dims = [c.dims for c in rec.layers[0].calls]
        assert len(calls) == 2 and dims[0] is dims[1] and dims[2].T == 5 and dims[0].T == 3
        assert dims[0].io_size == 3 * (6 + 4)
        d1, d2 = (decide("lin", lin, [dims[0]], "bk_mixed"),
                  decide("lin", lin, [dims[1]], "bk_mixed"))
        assert d1 is d2 and decide("lin", lin, [dims[2]], "bk_mixed").T == 5
        assert (decide("lin", lin, [dims[0]], "bk").use_ghost
                and not decide("lin", lin, [dims[0]], "per_sample").use_ghost)
    finally:
        rec.remove()
    t = torch.ones(3)
    assert cast(t, torch.float32) is t and cast(t, torch.float64).dtype == torch.float64


def test_bk_mixopt_ghost_norms_convolutions_on_small_feature_maps():
    """The time rule of "bk_mixopt" on ResNet-18's layers at 64²: a 256-channel 3×3 convolution on
    a 4×4 map (T = 16) is ghost-normed — its two float64 Grams cost far less than moving its
    590k-element per-sample gradient through memory — while a 64-channel one on a 16×16 map
    (T = 256) is instantiated."""
    small = pe.layer_plan(nn.Sequential(nn.Conv2d(256, 256, 3, padding=1)),
                          torch.randn(2, 256, 4, 4), mode="bk_mixopt")[0]
    large = pe.layer_plan(nn.Sequential(nn.Conv2d(64, 64, 3, padding=1)),
                          torch.randn(2, 64, 16, 16), mode="bk_mixopt")[0]
    assert (small.T, small.D, small.p) == (16, 2304, 256) and small.use_ghost
    assert (large.T, large.D, large.p) == (256, 576, 64) and not large.use_ghost


def test_book_keeping_keeps_gradients_a_little_larger_than_their_inputs(monkeypatch):
    """An instantiated convolution whose ``G_i`` (p·D = 4·36 = 144 numbers per sample) is a little
    larger than its ``(a, g)`` (2·4·16 = 128) keeps ``G_i``: its clipped sum is their contraction,
    no weight-gradient kernel over ``(a, g)`` — and the step is the float64 reference's."""
    from engine_checks import check_against_reference, gen_for, target_like
    from private_engine.layers import conv as conv_rule

    conv = nn.Conv2d(4, 4, 3, padding=1)  # T = 16: 2T² = 512 > pD = 144 > io = 128: instantiated
    torch.manual_seed(0)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)).double()
    released = []
    weighted = conv_rule.ConvRule.weighted_grads

    def spy(self, module, *args, **kwargs):
        released.append(module)
        return weighted(self, module, *args, **kwargs)

    monkeypatch.setattr(conv_rule.ConvRule, "weighted_grads", spy)
    gen = gen_for(7)
    x = torch.randn(3, 4, 4, 4, generator=gen, dtype=torch.float64)
    check_against_reference(model, [x, target_like(model, x, gen)], mode="bk_mixed", clip="abadi")
    assert not any(m is model[0] for m in released)
