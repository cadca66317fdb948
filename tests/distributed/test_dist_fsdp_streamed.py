"""FSDP2's per-unit all-gathers in the engine's backward, world size 2 (gloo, CPU).

In the book-keeping modes a physical batch is clipped with each FSDP2 unit gathered by FSDP2's
own backward hooks and resharded after its backward, and each unit's clipped sums are
reduce-scattered into the ranks' shard sums as soon as they are formed. An MLP of four Linear
layers, each its own unit (biases of 8 and 3 rows: padded shards):

* after four steps (the separability probe runs at the 1st and the 4th forward, with the whole
  model gathered; the next ones until the 8th are not probed), a logical batch
  of physical batches of different sizes, an empty one on each rank (rank 0: 3, 0, 2 samples;
  rank 1: 1, 4, 0), steps the shards by the float64 clipped mean computed sample by sample
  (noise 0, SGD at learning rate 1);
* during that step's backward passes at most two of the four units hold their gathered
  parameters at once (the unit in backward and the one FSDP2 prefetches), where gathering the
  whole model holds four;
* a crafted sample (inputs ×1e4) on rank 1 moves the release by at most R:
  ``B·‖Δupdate‖/R ≤ 1``.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from dist_spawn import run_ranks
from private_engine.clipping.functions import abadi_clip
from reference import reference_clipped_sum

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("no FSDP2 in this torch", allow_module_level=True)

B, R = 10, 0.1
MODES = ("bk_mixed", "bk", "bk_mixopt")
#: rank -> the slices of the step's physical batches
PIECES = {0: [slice(0, 3), slice(3, 3), slice(3, 5)], 1: [slice(5, 6), slice(6, 10),
                                                          slice(10, 10)]}


def _plain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _sharded():
    m = _plain()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fsdp.fully_shard(layer)
    return fsdp.fully_shard(m)


def _data(crafted: bool = False):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, 6, generator=g, dtype=torch.float64)
    if crafted:
        x[B - 1] *= 1e4
    return x, torch.randint(0, 3, (B,), generator=g)


def _loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _full(model):
    return torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]).clone()


def _engine(model, mode):
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    return engine, engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))


def _warm_up(rank, model, opt):
    """Four steps (the probe runs at the 1st and the 4th, with the whole model gathered)."""
    x, y = _data()
    sl = slice(rank * 5, rank * 5 + 5)
    for _ in range(4):
        opt.step(loss=_loss(model, x[sl], y[sl]))


def _gathered_spy(model):
    """Records, at every Linear's output gradient, how many units hold gathered parameters."""
    units = [g for m in model.modules() if isinstance(m, fsdp.FSDPModule)
             for g in m._get_fsdp_state()._fsdp_param_groups]
    seen = []

    def count(_):
        seen.append(sum(any(fp._unsharded_param.untyped_storage().size() > 0
                            for fp in g.fsdp_params) for g in units))

    def forward_hook(module, args, out):
        if out.requires_grad:
            out.register_hook(count)

    hooks = [m.register_forward_hook(forward_hook) for m in model if isinstance(m, nn.Linear)]
    return seen, hooks, len(units)


def _accumulated_step(rank, mode):
    model = _sharded()
    _, opt = _engine(model, mode)
    _warm_up(rank, model, opt)
    start = _full(model)
    seen, hooks, units = _gathered_spy(model)
    x, y = _data()
    pieces = PIECES[rank]
    for k, sl in enumerate(pieces):
        loss = _loss(model, x[sl], y[sl])
        (opt.step if k == len(pieces) - 1 else opt.virtual_step)(loss=loss)
    for h in hooks:
        h.remove()
    return {"start": start, "update": _full(model) - start, "gathered": max(seen),
            "units": units}


def _crafted(rank, mode):
    updates = []
    for with_it in (True, False):
        model = _sharded()
        _, opt = _engine(model, mode)
        _warm_up(rank, model, opt)
        before = _full(model)
        x, y = _data(crafted=True)
        sl = slice(0, 5) if rank == 0 else slice(5, B if with_it else B - 1)
        opt.step(loss=_loss(model, x[sl], y[sl]))
        updates.append(_full(model) - before)
    return float(B * (updates[0] - updates[1]).norm() / R)


def streamed_worker(rank, out_dir):
    warnings.simplefilter("ignore")
    return {mode: {"step": _accumulated_step(rank, mode), "crafted": _crafted(rank, mode)}
            for mode in MODES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(streamed_worker, tmp_path_factory.mktemp("dist_fsdp_streamed"),
                     timeout=300.0)


def _reference_update(start):
    """``−(Σ_i C_i g_i)/B`` at the parameters ``start``, one backward per sample (float64)."""
    model = _plain()
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(start[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    x, y = _data()
    sums, norms = reference_clipped_sum(model, [x, y], lambda m, xi, yi: _loss(m, xi, yi), R,
                                        abadi_clip)
    assert (norms > R).any()  # some samples are clipped: the test sees the factors
    return -torch.cat([s.flatten() for s in sums]) / B


@pytest.mark.parametrize("mode", MODES)
def test_streamed_accumulation_with_empty_batches_is_the_clipped_mean(ranks, mode):
    r0, r1 = ranks[0][mode]["step"], ranks[1][mode]["step"]
    assert torch.equal(r0["start"], r1["start"]) and torch.equal(r0["update"], r1["update"])
    want = _reference_update(r0["start"])
    assert want.abs().max() > 1e-3
    assert float((r0["update"] - want).abs().max()) <= 1e-9


@pytest.mark.parametrize("mode", MODES)
def test_streamed_backward_gathers_units_one_at_a_time(ranks, mode):
    for r in ranks:
        step = r[mode]["step"]
        assert step["units"] == 4
        assert step["gathered"] <= 2, step["gathered"]


@pytest.mark.parametrize("mode", MODES)
def test_streamed_crafted_sample_moves_release_by_at_most_R(ranks, mode):
    for r in ranks:
        assert 0.0 < r[mode]["crafted"] <= 1.0 + 1e-9
