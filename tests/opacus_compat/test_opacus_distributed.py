"""Distributed drop-in for Opacus: the same data-parallel training script (2 CPU processes, gloo)
run with ``opacus.PrivacyEngine`` and with ``private_engine.opacus_compat.PrivacyEngine`` gives the
same parameters on every rank (float64 MLP: to 1e-6 with noise 0, to 1e-5 — as the single-process
comparison in test_opacus_results.py — with noise and a seeded ``noise_generator``) and the same ε.

The model is wrapped in Opacus' ``DifferentiallyPrivateDistributedDataParallel`` (DPDDP) or in
torch's ``DistributedDataParallel``; batches come from a ``DistributedSampler``
(``poisson_sampling=False``) or from Opacus' distributed ``DPDataLoader`` (Poisson); both
``grad_sample_mode`` "hooks" and "ghost", flat and per-layer clipping, ``BatchMemoryManager``.
With noise 0 the run also equals one process training on the union of the ranks' batches.

All cases run in one ``torch.multiprocessing.spawn`` of two ranks (the module-scoped fixture);
each test then checks one case from what the ranks wrote.
"""
from __future__ import annotations

import gc
import socket
import traceback
import warnings
from datetime import timedelta

import opacus
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from private_engine import opacus_compat

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

WORLD = 2
N = 32  # samples in the data set
BATCH = 4  # per rank (DistributedSampler); the global logical batch is 8
STEPS = 3
TOL_NOISE0 = 1e-6
TOL = 1e-5  # test_opacus_results.py's tolerance

#: name → (wrapper, grad_sample_mode, noise_multiplier, loader, clipping, loss_reduction)
CASES = {
    "dpddp-hooks-noise0": ("dpddp", "hooks", 0.0, "sampler", "flat", "mean"),
    "dpddp-hooks-noise": ("dpddp", "hooks", 1.0, "sampler", "flat", "mean"),
    "dpddp-ghost-noise0": ("dpddp", "ghost", 0.0, "sampler", "flat", "mean"),
    "dpddp-ghost-noise": ("dpddp", "ghost", 1.0, "sampler", "flat", "mean"),
    "dpddp-hooks-sum": ("dpddp", "hooks", 1.0, "sampler", "flat", "sum"),
    "dpddp-hooks-poisson": ("dpddp", "hooks", 1.0, "poisson", "flat", "mean"),
    "dpddp-ghost-poisson": ("dpddp", "ghost", 1.0, "poisson", "flat", "mean"),
    "dpddp-hooks-bmm": ("dpddp", "hooks", 1.0, "bmm", "flat", "mean"),
    "dpddp-hooks-per_layer": ("dpddp", "hooks", 1.0, "sampler", "per_layer", "mean"),
    "ddp-hooks-noise0": ("ddp", "hooks", 0.0, "sampler", "flat", "mean"),
    "ddp-hooks-noise": ("ddp", "hooks", 1.0, "sampler", "flat", "mean"),
    "ddp-ghost-noise": ("ddp", "ghost", 1.0, "sampler", "flat", "mean"),
    # DDP(find_unused_parameters=True, gradient_as_bucket_view=True)
    "ddp_options-hooks-noise": ("ddp_options", "hooks", 1.0, "sampler", "flat", "mean"),
    # make_private(wrap_model=False): the script keeps calling its DPDDP model
    "dpddp_nowrap-hooks-noise": ("dpddp_nowrap", "hooks", 1.0, "sampler", "flat", "mean"),
    "dpddp_nowrap-ghost-noise": ("dpddp_nowrap", "ghost", 1.0, "sampler", "flat", "mean"),
}


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    return TensorDataset(x, y)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(engine_cls, case, *, distributed=True):
    """The Opacus script; ``distributed=False``: one process on the union of the ranks' batches
    (noise 0 only). Returns (flat parameters, ε at δ=1e-5, physical batch sizes)."""
    wrap, mode, noise, loading, clipping, reduction = CASES[case]
    torch.manual_seed(0)
    model = _mlp()
    ds = _data()
    if not distributed:  # step k: rank 0's and rank 1's k-th DistributedSampler batches
        order = [list(range(r, N, WORLD)) for r in range(WORLD)]
        batches = [sum((o[k * BATCH:(k + 1) * BATCH] for o in order), [])
                   for k in range(N // (WORLD * BATCH))]
        loader = DataLoader(ds, batch_sampler=batches)
    elif loading == "sampler":
        loader = DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, shuffle=False))
    else:  # Poisson: opacus' distributed DPDataLoader over a loader of 4 global batches of 8
        loader = DataLoader(ds, batch_size=WORLD * BATCH)
    if not distributed:
        module = model
    elif wrap.startswith("dpddp"):
        module = DPDDP(model)
    elif wrap == "ddp_options":
        module = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=True)
    else:
        module = DDP(model)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.5)
    n_params = sum(1 for _ in model.parameters())
    R = 0.1 if clipping == "flat" else [0.05] * n_params
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    engine = engine_cls(accountant="rdp")
    out = engine.make_private(
        module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=noise,
        max_grad_norm=R, loss_reduction=reduction, poisson_sampling=loading in ("poisson", "bmm"),
        grad_sample_mode=mode, criterion=criterion, clipping=clipping,
        noise_generator=torch.Generator().manual_seed(7), wrap_model=not wrap.endswith("nowrap"))
    if len(out) == 4:
        private, optimizer, criterion, loader = out
    else:
        private, optimizer, loader = out
    if wrap.endswith("nowrap"):
        private = module  # the returned object holds the hooks only
    torch.manual_seed(3)  # Poisson sampling draws from the global generator (noise_generator given)
    sizes = []
    if loading == "bmm":
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2,
                                optimizer=optimizer) as batches:
            for xb, yb in batches:
                sizes.append(len(yb))
                criterion(private(xb), yb).backward()
                optimizer.step()
                optimizer.zero_grad()
    else:
        for step, (xb, yb) in enumerate(loader):
            if step == STEPS:
                break
            sizes.append(len(yb))
            criterion(private(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
    eps = engine.get_epsilon(1e-5) if noise > 0 else 0.0
    return _flat(model), eps, sizes, type(optimizer).__name__


def _refusals(rank):
    """What make_private refuses, or gives back, in distributed training."""
    found = {}
    model = _mlp()
    x, y = _data().tensors
    loader = DataLoader(TensorDataset(x, y), batch_size=8)

    def make(module, **kw):
        return opacus_compat.PrivacyEngine().make_private(
            module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, **kw)

    for name, build, kw in (
            ("static_graph", lambda: DDP(model, static_graph=True), {}),
            ("ghost_fsdp", lambda: DPDDP(model), dict(grad_sample_mode="ghost_fsdp"))):
        try:
            make(build(), **kw)
            found[name] = "accepted"
        except ValueError as e:
            found[name] = str(e)
    # DDP's backward all-reduce is off while the hooks are on, and back on after cleanup()
    ddp = DDP(model)
    private, _, _ = make(ddp)
    found["ddp_sync_during"] = ddp.require_backward_grad_sync
    with ddp.no_sync():
        pass
    private(x[:2]).sum()  # a forward keeps it off (no_sync restored the flag it found)
    found["ddp_sync_after_no_sync"] = ddp.require_backward_grad_sync
    private.cleanup()
    found["ddp_sync_after_cleanup"] = ddp.require_backward_grad_sync
    # the state_dict keys are Opacus' (GradSampleModule(DPDDP(model)): _module.module.…)
    private, _, _ = make(DPDDP(model))
    found["state_dict_keys"] = sorted(private.state_dict())
    private.cleanup()
    return found


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    results = {}
    try:
        for case in CASES:
            theirs = _train(opacus.PrivacyEngine, case)
            ours = _train(opacus_compat.PrivacyEngine, case)
            single = None
            if CASES[case][2] == 0.0 and rank == 0:
                single = _train(opacus_compat.PrivacyEngine, case, distributed=False)[0]
            results[case] = dict(theirs=theirs, ours=ours, single=single)
        results["refusals"] = _refusals(rank)
    except BaseException:
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        # DDP reducers (in reference cycles) must go while the interpreter is alive: a gloo work
        # they hold, destroyed at interpreter exit, aborts the process now and then
        gc.collect()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case, run once by two gloo ranks; returns ``[rank 0's results, rank 1's]``."""
    out_dir = tmp_path_factory.mktemp("opacus_distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_same_parameters_and_epsilon_as_opacus_on_every_rank(ranks, case):
    noise = CASES[case][2]
    tol = TOL_NOISE0 if noise == 0 else TOL
    torch.manual_seed(0)
    start = _flat(_mlp())
    for rank, results in enumerate(ranks):
        (a, eps_a, sizes_a, cls_a), (b, eps_b, sizes_b, cls_b) = (results[case]["theirs"],
                                                                   results[case]["ours"])
        assert cls_a.startswith("Distributed") or cls_a == "SimpleDistributedPerLayerOptimizer"
        assert cls_b.startswith("Distributed"), cls_b
        assert sizes_a == sizes_b
        diff = (a - b).abs().max().item()
        assert diff < tol, f"{case} rank {rank}: parameters differ by {diff:.2e}"
        assert eps_a == eps_b
        assert (b - start).abs().max().item() > 100 * TOL  # training moved the parameters
    # every rank holds the same parameters and the same ε
    assert torch.equal(ranks[0][case]["ours"][0], ranks[1][case]["ours"][0])
    assert ranks[0][case]["ours"][1] == ranks[1][case]["ours"][1]
    if noise == 0:  # each rank clips its own shard's samples; together: one global batch
        diff = (ranks[0][case]["single"] - ranks[0][case]["ours"][0]).abs().max().item()
        assert diff < TOL_NOISE0, f"{case}: one process on the global batches differs by {diff}"


def test_unsupported_distributed_setups_are_refused(ranks):
    for results in ranks:
        found = results["refusals"]
        assert "static_graph=True" in found["static_graph"]
        assert "DifferentiallyPrivateDistributedDataParallel" in found["static_graph"]
        assert "FSDP" in found["ghost_fsdp"]


def test_ddp_backward_all_reduce_is_off_while_hooked(ranks):
    for results in ranks:
        found = results["refusals"]
        assert found["ddp_sync_during"] is False
        assert found["ddp_sync_after_no_sync"] is False
        assert found["ddp_sync_after_cleanup"] is True


def test_state_dict_keys_as_opacus(ranks):
    assert ranks[0]["refusals"]["state_dict_keys"] == [
        "_module.module.0.bias", "_module.module.0.weight", "_module.module.2.bias",
        "_module.module.2.weight"]
