"""Data-parallel native engine, world size 2 (gloo, CPU): noise once, accounting, checks, state.

* The noise is added once in total: with zero gradients the released update's per-coordinate
  standard deviation is σR/B (a chi-square test over 20,200 coordinates), not √2·σR/B; only rank
  0 holds a noise generator, and the replicas receive the same noisy update.
* ε (and σ calibrated from a target ε) equals the single-process value of the same run.
* The sampling-rate check counts the global logical batch (ranks' counts summed): each rank
  feeding the whole declared batch is refused on every rank, with nothing updated.
* A rank whose clipping raises makes every rank raise (no rank is left waiting); the next step
  works.
* ``check_replicas=True`` raises on every rank when one rank's parameters were changed.
* Checkpoints: rank 0 writes, the others do not; every rank loads; training goes on in step.
* ``poisson_loader`` under the process group: each rank samples its own shard, every batch
  (empty ones included) is yielded, each rank's generator is its own; a Poisson epoch trains in
  lockstep.
* A model wrapped in ``DistributedDataParallel`` is refused.

Everything runs in one spawn of two ranks (the module fixture); each test checks what they
returned.
"""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import TensorDataset

import private_engine as pe
from dist_spawn import run_ranks
from private_engine.data import LockstepPoissonSampler, poisson_loader
from private_engine.optim import ReplicaMismatchError

pytestmark = pytest.mark.slow

B, N = 8, 64
SIGMA = 1.0


def _mlp(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).double()


def _batch(seed, size=B):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (size,), generator=g))


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _mine(rank, x, y):
    half = x.shape[0] // 2
    return x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]


def _noise_once(rank):
    """Zero gradients, σ = 1, R = 1: the updates (lr 1) of two steps are pure noise / B."""
    torch.manual_seed(0)
    model = nn.Linear(100, 100).double()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                              noise_multiplier=SIGMA, distributed=True)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    g = torch.Generator().manual_seed(3)
    deltas = []
    for _ in range(2):
        x = torch.randn(B // 2, 100, generator=g, dtype=torch.float64)
        before = _flat(model)
        opt.step(loss=(model(x) * 0.0).sum(1))
        deltas.append(_flat(model) - before)
    return {"delta": torch.cat(deltas), "has_generator": engine.noise_generator is not None}


def _epsilon(rank):
    out = {}
    model = _mlp()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                              noise_multiplier=SIGMA, distributed=True)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    for t in range(3):
        opt.step(loss=_loss(model, *_mine(rank, *_batch(t))))
    out["eps"] = engine.get_epsilon()
    out["steps"] = engine.steps_taken
    single = _mlp()
    ref = pe.PrivacyEngine(single, batch_size=B, sample_size=N, max_grad_norm=1.0,
                           noise_multiplier=SIGMA, distributed=False)
    ref_opt = ref.attach(torch.optim.SGD(single.parameters(), lr=0.1))
    for t in range(3):
        ref_opt.step(loss=_loss(single, *_batch(t)))
    out["eps_single"] = ref.get_epsilon()
    acc = RDPAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=SIGMA, sample_rate=B / N)
    out["eps_rdp"] = acc.get_epsilon(delta=1 / (2 * N))
    kwargs = dict(batch_size=B, sample_size=N, max_grad_norm=1.0, target_epsilon=2.0, epochs=2)
    out["sigma"] = pe.PrivacyEngine(_mlp(), distributed=True, **kwargs).noise_multiplier
    out["sigma_single"] = pe.PrivacyEngine(_mlp(), distributed=False, **kwargs).noise_multiplier
    return out


def _sampling_check(rank):
    """batch_size 8 of n = 1000: 16 samples per rank pass a per-rank count (|16 − 8| ≤ 20.7)
    but not the global one (|32 − 8| > 20.7)."""
    model = _mlp()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=1000, max_grad_norm=1.0,
                              noise_multiplier=SIGMA, distributed=True)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    before = _flat(model)
    error = None
    try:
        opt.step(loss=_loss(model, *_batch(5 + rank, size=16)))
    except pe.SamplingRateError as e:
        error = type(e).__name__
    unchanged = torch.equal(before, _flat(model)) and engine.steps_taken == 0
    opt.step(loss=_loss(model, *_mine(rank, *_batch(7))))
    return {"error": error, "unchanged": unchanged, "steps": engine.steps_taken,
            "samples": engine.sampling_check.samples}


def _failing_rank(rank):
    model = _mlp()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                              noise_multiplier=SIGMA, distributed=True)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    before = _flat(model)
    x, y = _mine(rank, *_batch(8))
    loss = _loss(model, x, y)
    error = None
    try:
        opt.step(loss=loss[:, None] if rank == 1 else loss)  # rank 1: a malformed loss
    except (ValueError, RuntimeError) as e:
        error = (type(e).__name__, str(e))
    unchanged = torch.equal(before, _flat(model)) and engine.steps_taken == 0
    opt.step(loss=_loss(model, x, y))
    return {"error": error, "unchanged": unchanged, "after": _flat(model),
            "steps": engine.steps_taken}


def _check_replicas(rank):
    model = _mlp()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                              noise_multiplier=SIGMA, distributed=True, check_replicas=True)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.step(loss=_loss(model, *_mine(rank, *_batch(9))))  # replicas equal: no error
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] += 1e-3
        engine.state_guard.arm()  # an edit on purpose, not from data: the state guard accepts it
    try:
        opt.step(loss=_loss(model, *_mine(rank, *_batch(10))))
    except ReplicaMismatchError as e:
        return {"error": str(e), "steps": engine.steps_taken}
    return {"error": None, "steps": engine.steps_taken}


def _checkpoint(rank, out_dir):
    def build():
        model = _mlp()
        engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                                  noise_multiplier=SIGMA, distributed=True)
        return model, engine, engine.attach(torch.optim.Adam(model.parameters(), lr=0.05))

    model, engine, opt = build()
    opt.step(loss=_loss(model, *_mine(rank, *_batch(11))))
    path = os.path.join(out_dir, "ckpt.pt")
    mine = path if rank == 0 else os.path.join(out_dir, "ckpt_rank1.pt")
    pe.save_checkpoint(mine, model=model, optimizer=opt, engine=engine, extra={"epoch": 1})
    saved_state = engine.noise_generator.get_state() if rank == 0 else None
    opt.virtual_step(loss=_loss(model, *_mine(rank, *_batch(12))))
    try:
        pe.save_checkpoint(mine, model=model, optimizer=opt, engine=engine)
        refused = False
    except ValueError:
        refused = True
    opt.step(loss=_loss(model, *_mine(rank, *_batch(14))))  # released after the checkpoint
    dist.barrier()  # rank 0's file is written
    model2, engine2, opt2 = build()
    extra = pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    loaded_steps = engine2.steps_taken  # the ledger's: the step after the checkpoint counts
    fresh = (not torch.equal(engine2.noise_generator.get_state(), saved_state) if rank == 0
             else engine2.noise_generator is None)
    opt2.step(loss=_loss(model2, *_mine(rank, *_batch(13))))
    return {"rank1_file": os.path.exists(os.path.join(out_dir, "ckpt_rank1.pt")),
            "ledgers": sorted(n for n in os.listdir(out_dir) if n.endswith(".ledger")),
            "refused": refused, "extra": extra, "fresh": fresh, "after": _flat(model2),
            "loaded_steps": loaded_steps, "steps": engine2.steps_taken}


def _loader(rank):
    out = {}
    data = TensorDataset(torch.arange(40))
    loader = poisson_loader(data, 1)  # q = 1/40: 40 batches per epoch, most of them empty
    out["sampler"] = type(loader.batch_sampler).__name__
    batches = [b[0].tolist() for b in loader]
    out["batches"] = len(batches)
    out["empty"] = sum(not b for b in batches)
    out["indices"] = sorted({i for b in batches for i in b})
    out["generator"] = loader.generator.get_state()
    # a Poisson epoch of training, every rank in step, replicas checked
    x, y = _batch(14, size=N)
    model = _mlp()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                              noise_multiplier=SIGMA, check_replicas=True)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    local = 0
    for xb, yb in poisson_loader(TensorDataset(x, y), B):
        opt.step(loss=_loss(model, xb, yb))
        local += xb.shape[0]
    out.update(steps=engine.steps_taken, local=local, samples=engine.sampling_check.samples,
               eps=engine.get_epsilon(), after=_flat(model))
    return out


def _ddp_refused(rank):
    ddp = nn.parallel.DistributedDataParallel(_mlp())
    try:
        pe.PrivacyEngine(ddp, batch_size=B, sample_size=N, max_grad_norm=1.0,
                         noise_multiplier=SIGMA)
    except ValueError as e:
        return str(e)
    return None


def noise_worker(rank, out_dir):
    warnings.simplefilter("ignore")
    return {"noise": _noise_once(rank), "epsilon": _epsilon(rank),
            "sampling": _sampling_check(rank), "failing": _failing_rank(rank),
            "replicas": _check_replicas(rank), "checkpoint": _checkpoint(rank, out_dir),
            "loader": _loader(rank), "ddp": _ddp_refused(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(noise_worker, tmp_path_factory.mktemp("dist_noise"))


def test_noise_is_added_once(ranks):
    r0, r1 = ranks[0]["noise"], ranks[1]["noise"]
    assert torch.equal(r0["delta"], r1["delta"])
    assert r0["has_generator"] and not r1["has_generator"]
    delta = r0["delta"]
    d = delta.numel()
    std = SIGMA * 1.0 / B
    ratio = float(delta.square().mean() / std ** 2)  # ~ χ²_d / d: mean 1, sd (2/d)^½ ≈ 0.01
    assert abs(ratio - 1.0) < 6 * math.sqrt(2 / d)
    assert ratio < 1.5  # noise on both ranks would give 2
    assert abs(float(delta.mean())) < 6 * std / math.sqrt(d)


def test_epsilon_equals_single_process(ranks):
    r0, r1 = ranks[0]["epsilon"], ranks[1]["epsilon"]
    assert r0["steps"] == r1["steps"] == 3
    assert r0["eps"] == r1["eps"] == pytest.approx(r0["eps_single"], rel=1e-12)
    assert r0["eps"] == pytest.approx(r0["eps_rdp"], rel=1e-12)
    assert r0["sigma"] == r1["sigma"] == r0["sigma_single"]


def test_sampling_check_counts_the_global_batch(ranks):
    for r in ranks:
        s = r["sampling"]
        assert s["error"] == "SamplingRateError"
        assert s["unchanged"]
        assert s["steps"] == 1 and s["samples"] == B  # then 4 + 4 samples: one step of 8


def test_a_failing_rank_makes_every_rank_raise(ranks):
    e0, e1 = ranks[0]["failing"]["error"], ranks[1]["failing"]["error"]
    assert e1[0] == "ValueError"
    assert e0[0] == "RuntimeError" and "rank(s) [1]" in e0[1]
    for r in ranks:
        assert r["failing"]["unchanged"] and r["failing"]["steps"] == 1
    assert torch.equal(ranks[0]["failing"]["after"], ranks[1]["failing"]["after"])


def test_check_replicas_raises_on_every_rank(ranks):
    for r in ranks:
        assert r["replicas"]["error"] is not None and "differ" in r["replicas"]["error"]
        assert r["replicas"]["steps"] == 2  # the step was released and accounted


def test_checkpoint_written_by_rank0_loaded_everywhere(ranks):
    c0, c1 = ranks[0]["checkpoint"], ranks[1]["checkpoint"]
    assert not c0["rank1_file"]  # rank 1 returned without writing
    assert c0["ledgers"] == ["ckpt.pt.ledger"]  # rank 0 records the steps
    assert c0["refused"] and c1["refused"]  # accumulation in progress
    assert c0["extra"] == c1["extra"] == {"epoch": 1}
    assert c0["fresh"] and c1["fresh"]  # no generator state: fresh noise on rank 0
    assert c0["loaded_steps"] == c1["loaded_steps"] == 2
    assert c0["steps"] == c1["steps"] == 3
    assert torch.equal(c0["after"], c1["after"])


def test_poisson_loader_shards_and_lockstep(ranks):
    l0, l1 = ranks[0]["loader"], ranks[1]["loader"]
    for lo in (l0, l1):
        assert lo["sampler"] == LockstepPoissonSampler.__name__
        assert lo["batches"] == 40  # every batch, the empty ones too
        assert lo["empty"] > 0
    assert not set(l0["indices"]) & set(l1["indices"])  # disjoint shards
    assert not torch.equal(l0["generator"], l1["generator"])  # each rank its own generator
    assert l0["steps"] == l1["steps"] == N // B
    assert l0["samples"] == l1["samples"] == l0["local"] + l1["local"]
    assert l0["eps"] == l1["eps"] > 0
    assert torch.equal(l0["after"], l1["after"])


def test_ddp_wrapper_is_refused(ranks):
    for r in ranks:
        assert r["ddp"] is not None and "bare module" in r["ddp"]
