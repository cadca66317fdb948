"""Clipped sums in flat buffers (private_engine/grad_sums.py) and the grouped kept per-sample
gradients of the book-keeping modes: every parameter's slot written exactly once (poisoned buffers),
grouping thresholds that change nothing but speed, accumulation across physical batches whose
layouts differ, rules without ``out=``."""
import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
import private_engine.clipping.kept as clipping
import private_engine.clipping.sums as sums_module
from engine_checks import check_against_reference, gen_for, make_engine
from private_engine.clipping.grad_sums import FlatLayout, GradSums, LazyBuffers
from private_engine.layers import register_rule
from private_engine.layers.linear import LinearRule
from reference import assert_close_rel, reference_clipped_sum

pytestmark = pytest.mark.usefixtures("one_thread")

BK_MODES = ("bk", "bk_mixed", "bk_mixopt")


# -- the layout ------------------------------------------------------------------------------------
def test_layout_slots_segments_and_views():
    ps = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4, dtype=torch.float64)),
          nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(1, 1, dtype=torch.bfloat16))]
    layout = FlatLayout(ps)
    buffers, views = layout.allocate(ps)
    # float32 and bfloat16 parameters share the float32 buffer (sums accumulate in ≥ float32),
    # float64 its own
    assert [(b.dtype, b.numel()) for b in buffers] == [(torch.float32, 12), (torch.float64, 4)]
    assert [v.shape for v in views] == [p.shape for p in ps]
    assert [v.dtype for v in views] == [torch.float32, torch.float64, torch.float32, torch.float32]
    for k, v in enumerate(views):  # disjoint and covering: write k everywhere, read back
        v.fill_(k)
    assert buffers[0].tolist() == [0.0] * 6 + [2.0] * 5 + [3.0]
    assert buffers[1].tolist() == [1.0] * 4
    seg = layout.segment(buffers, [ps[2], ps[3]])
    assert seg is not None and seg.data_ptr() == views[2].data_ptr() and seg.numel() == 6
    # back to back in buffer 0 (ps[1] is in another)
    assert layout.segment(buffers, [ps[0], ps[2]]).numel() == 11
    assert layout.segment(buffers, [ps[2], ps[0]]) is None  # not in slot order
    assert layout.segment(buffers, [ps[0], ps[1]]) is None  # two buffers
    assert [t.numel() for t in layout.segments(buffers, [ps[0], ps[1], ps[2], ps[3]])] == [6, 4, 6]
    with pytest.raises(ValueError):
        FlatLayout([ps[0], ps[0]])


def test_layout_of_bounded_buffers_and_lazy_allocation():
    """``max_elements`` closes a buffer before it would grow past it (a parameter is never split;
    a larger one gets a buffer of its own); :class:`LazyBuffers` allocates a buffer only when a
    view into it is asked for; ``own_grads`` drops the buffers one by one and hands out tensors
    of their own, divided."""
    ps = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(9)),
          nn.Parameter(torch.zeros(2, dtype=torch.float64)), nn.Parameter(torch.zeros(2))]
    layout = FlatLayout(ps, max_elements=8)
    assert [layout.slots[id(p)][:2] for p in ps] == [(0, 0), (0, 3), (1, 0), (2, 0), (3, 0)]
    assert layout.buffer_index(ps) == [0, 0, 1, 2, 3]
    lazy = LazyBuffers(layout)
    assert lazy.buffers == [None] * 4
    assert lazy.segment([ps[0], ps[1]]).numel() == 7 and lazy.buffers[1] is None
    assert lazy.segment([ps[1], ps[2]]) is None  # two buffers
    lazy[id(ps[3])].fill_(2.0)
    assert lazy.buffers[1] is None and lazy.buffers[2] is not None
    full = lazy.all()
    for k, p in enumerate(ps):
        lazy[id(p)].fill_(k + 1.0)
    sums = GradSums([lazy[id(p)] for p in ps], full, layout, layout.buffer_index(ps))
    freed = [weakref.ref(b.untyped_storage()) for b in full]
    del full, lazy
    grads = sums.own_grads(2.0)
    assert [g.tolist() for g in grads] == [[(k + 1) / 2] * p.numel() for k, p in enumerate(ps)]
    assert all(g.untyped_storage().nbytes() == g.numel() * g.element_size() for g in grads)
    assert all(r() is None for r in freed)
    assert sums.layout is None and sums.grads is grads


def test_grad_sums_add_by_buffer_or_by_parameter():
    ps = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
    layout = FlatLayout(ps)
    a_buf, a_views = layout.allocate(ps)
    b_buf, b_views = layout.allocate(ps)
    a_buf[0].copy_(torch.arange(7.0))
    b_buf[0].fill_(1.0)
    a = GradSums(a_views, a_buf, layout)
    a.add_(GradSums(b_views, b_buf, layout))  # same layout: one add on the buffer
    assert a_buf[0].tolist() == [1.0, 2, 3, 4, 5, 6, 7]
    # different layout: per parameter
    other = GradSums.separate([torch.full((3,), 10.0), torch.full((2, 2), 100.0)])
    a.add_(other)
    assert (a.grads[0].tolist() == [11.0, 12, 13]
            and a.grads[1].flatten().tolist() == [104.0, 105, 106, 107])
    other.add_(a)
    assert other.grads[0].tolist() == [21.0, 22, 23]


# -- the engine ------------------------------------------------------------------------------------
class Branchy(nn.Module):
    """LayerNorm (kept per-sample gradients), Linear layers (pairs or kept gradients by mode), an
    Embedding, and an unused branch whose parameters the loss never reaches (their sums must be
    exact zeros)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)
        self.unused = nn.Linear(6, 4)

    def forward(self, ids):
        h = self.emb(ids)
        return self.fc2(self.norm(torch.tanh(self.fc1(h)))).mean(1)


def _loss(model, ids, y):
    return F.cross_entropy(model(ids), y, reduction="none")


@pytest.fixture
def poisoned(monkeypatch):
    """Flat buffers filled with NaN when allocated: a slot the engine forgets to write (or adds to)
    shows."""
    original = FlatLayout.new_buffer

    def new_buffer(self, b):
        return original(self, b).fill_(float("nan"))

    monkeypatch.setattr(FlatLayout, "new_buffer", new_buffer)


@pytest.mark.parametrize("mode", BK_MODES + ("mixed",))
@pytest.mark.parametrize("small", [0, 1 << 30], ids=["alone", "grouped"])
@pytest.mark.parametrize("chunk", [None, 60], ids=["one_buffer", "buffers"])
def test_every_slot_written_once_and_unreached_parameters_zero(poisoned, monkeypatch, mode, small,
                                                               chunk):
    """With one flat buffer per dtype or many small ones (allocated as they are written, kept
    groups then straddling buffers), every slot is written once, the sums match the float64
    reference and parameters the loss does not reach are exact zeros."""
    if chunk is not None:
        monkeypatch.setattr(sums_module, "SUM_BUFFER_ELEMENTS", chunk)
    monkeypatch.setattr(clipping, "KEPT_SMALL_CPU", small)
    monkeypatch.setattr(clipping, "KEPT_GROUP_ELEMENTS", 200)  # several groups when grouped
    torch.manual_seed(0)
    model = Branchy().double()
    gen = gen_for(1)
    ids = torch.randint(0, 11, (5, 7), generator=gen)
    y = torch.randint(0, 3, (5,), generator=gen)
    engine = check_against_reference(model, [ids, y], _loss, mode=mode, clip="abadi")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads, _ = pe.PrivacyEngine(model, batch_size=5, sample_size=50, max_grad_norm=1.0,
                                noise_multiplier=0.0,
                                clipping_mode=mode).clipped_grad_sum(_loss(model, ids, y))
    for n, g in zip(names, grads):
        assert torch.isfinite(g).all(), f"{n}: slot not written"
        if n.startswith("unused"):
            assert torch.equal(g, torch.zeros_like(g)), f"{n}: the loss does not reach it"
    assert engine is not None


@pytest.mark.parametrize("mode", BK_MODES)
@pytest.mark.parametrize("chunk", [None, 700], ids=["one_buffer", "buffers"])
def test_step_grads_are_own_tensors_noised_once(monkeypatch, mode, chunk):
    """After a book-keeping step (sums in one flat buffer) every .grad is a tensor of its own — a
    copy of it copies that parameter's gradient, not the whole buffer (Opacus deep-copies p.grad) —
    and the noise is N(0, (σR/B)²) per coordinate, drawn once (not per view, not twice on any
    coordinate)."""
    if chunk is not None:
        monkeypatch.setattr(sums_module, "SUM_BUFFER_ELEMENTS", chunk)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 50), nn.LayerNorm(50), nn.Linear(50, 30))
    for p in model.parameters():
        p.requires_grad_(True)
    sigma, R, B = 2.0, 1e-9, 4  # R tiny: the clipped sum vanishes next to the noise
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=40, max_grad_norm=R,
                              noise_multiplier=sigma, clipping_mode=mode,
                              noise_generator=torch.Generator().manual_seed(5))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    x = torch.randn(B, 20)
    opt.step(loss=model(x).pow(2).sum(1))
    grads = [p.grad for p in model.parameters()]
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)
    for g in grads:
        assert g.untyped_storage().nbytes() == g.numel() * g.element_size()
        assert copy.deepcopy(g).untyped_storage().nbytes() == g.numel() * g.element_size()
    grads_, _ = engine.clipped_grad_sum(model(x).pow(2).sum(1))
    assert all(g.untyped_storage().nbytes() == g.numel() * g.element_size() for g in grads_)
    flat = torch.cat([g.flatten() for g in grads]).double() / (sigma * R / B)
    n = flat.numel()
    assert abs(flat.mean().item()) < 4 / math.sqrt(n)
    assert abs(flat.std().item() - 1.0) < 4 / math.sqrt(2 * n)


def test_accumulation_across_batches_with_different_layouts():
    """bk_mixed keeps a Linear's (a, g) for a short sequence (ghost) and its per-sample gradient for
    a long one (p·D ≤ T·(D + p)): two physical batches with different flat layouts still add up to
    the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    loss_fn = lambda m, x: m(x).pow(2).mean(1).sum(1)  # noqa: E731
    gen = gen_for(2)
    short = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
    long = torch.randn(3, 9, 8, generator=gen, dtype=torch.float64)
    R = 0.05
    ref_short, _ = reference_clipped_sum(model, [short], loss_fn, R, pe.abadi_clip)
    ref_long, _ = reference_clipped_sum(model, [long], loss_fn, R, pe.abadi_clip)
    engine = pe.PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=R,
                              noise_multiplier=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.virtual_step(loss=loss_fn(model, short))
    plan_short = [d.use_ghost for d in engine.layer_plan]
    first_layout = engine._attached[0].grad_sums.layout
    opt.step(loss=loss_fn(model, long))
    plan_long = [d.use_ghost for d in engine.layer_plan]
    assert plan_short != plan_long, "the case must change how a layer is kept"
    assert first_layout is not engine.clipper.sums._layout
    expected = [-(a + b) / 6 for a, b in zip(ref_short, ref_long)]
    assert_close_rel([p.detach() - b for p, b in zip(model.parameters(), before)], expected, 1e-9)


class _OldStyleLinear(nn.Linear):
    pass


class _OldStyleRule(LinearRule):
    """A user rule written against the signature before ``out=`` existed."""

    module_types = (_OldStyleLinear,)

    def weighted_grads(self, module, calls, factors):
        return super().weighted_grads(module, calls, factors)

    # the same sum: the same bound
    def certified_norm_sq(self, module, calls, use_ghost, grads=None):
        return super().certified_norm_sq(module, calls, use_ghost, grads)


class _UncertifiedLinear(nn.Linear):
    pass


class _UncertifiedRule(LinearRule):
    """Overrides the clipped sum but inherits a certificate written for another one."""

    module_types = (_UncertifiedLinear,)

    def weighted_grads(self, module, calls, factors, out=None):
        return super().weighted_grads(module, calls, factors, out)


def test_rule_overriding_the_sum_without_its_certificate_is_refused():
    register_rule(_UncertifiedRule())
    model = nn.Sequential(_UncertifiedLinear(5, 6))
    with pytest.raises(ValueError, match="overrides weighted_grads but not certified_norm_sq"):
        make_engine(model, 4)


def test_rule_without_out_parameter_is_refused():
    register_rule(_OldStyleRule())
    model = nn.Sequential(_OldStyleLinear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    with pytest.raises(ValueError, match="without the out= argument"):
        make_engine(model, 4)


class _KwargsLinear(nn.Linear):
    pass


class _KwargsRule(LinearRule):
    """A rule that forwards ``**kwargs`` (``out=`` among them) to the built-in."""

    module_types = (_KwargsLinear,)

    def weighted_grads(self, module, calls, factors, **kwargs):
        return super().weighted_grads(module, calls, factors, **kwargs)

    def certified_norm_sq(self, module, calls, use_ghost, grads=None):
        return super().certified_norm_sq(module, calls, use_ghost, grads)


def test_rule_taking_out_through_kwargs_works():
    register_rule(_KwargsRule())
    torch.manual_seed(0)
    model = nn.Sequential(_KwargsLinear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(4, 3, 5, generator=gen_for(3), dtype=torch.float64)
    check_against_reference(model, [x], lambda m, x: m(x).pow(2).sum((1, 2)), mode="bk",
                            clip="abadi")


def test_layer_norm_gradients_grouped_at_any_batch_match_the_reference(kept_group_shapes):
    """On the CPU a kept gradient is small by its elements per sample: a LayerNorm(768)'s weight
    and bias at batch 24 (18,432 elements each) form one group, whose clipped sums and norms
    match the float64 reference."""
    shapes = kept_group_shapes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 768), nn.LayerNorm(768), nn.Linear(768, 3)).double()
    with torch.no_grad():
        model[1].weight.add_(0.3 * torch.randn(768, dtype=torch.float64))
    x = torch.randn(24, 4, generator=gen_for(2), dtype=torch.float64)
    t = torch.randn(24, 3, generator=gen_for(3), dtype=torch.float64)
    check_against_reference(model, [x, t], mode="bk_mixed", clip="abadi")
    assert (24, 2 * 768) in shapes, shapes


class _Tokens(nn.Module):
    """A class token and a position embedding on a sequence (traced parameters, instantiated and
    kept after the layers' gradients), a LayerNorm and a Linear head (instantiated in
    ``bk_mixed``): the position embedding's gradient (40·64 = 2,560 elements per sample: large on
    the CPU) comes between the layers' and the class token's (64: small)."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(0.5 * torch.randn(1, 1, 64))
        self.pos = nn.Parameter(0.5 * torch.randn(1, 40, 64))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(x)).mean(1)


def test_small_kept_gradients_grouped_across_a_large_one(kept_group_shapes):
    """A large kept gradient (the position embedding) between small ones (the layers', the class
    token's) leaves their group open: one group of the small ones and the large one alone, whose
    norms and clipped sums match the float64 reference."""
    shapes = kept_group_shapes
    torch.manual_seed(0)
    model = _Tokens().double()
    x = torch.randn(6, 39, 64, generator=gen_for(4), dtype=torch.float64)
    t = torch.randn(6, 3, generator=gen_for(5), dtype=torch.float64)
    check_against_reference(model, [x, t], mode="bk_mixed", clip="abadi")
    # the head's weight and bias (instantiated: 40 positions), the LayerNorm's, the class token's
    assert set(shapes) == {(6, 3 * 64 + 3 + 2 * 64 + 64), (6, 40 * 64)}, shapes
