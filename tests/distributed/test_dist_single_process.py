"""Data-parallel options without a second process: ``distributed=True`` with no process group is
refused with a clear error (engine and ``poisson_loader``), ``None`` means one process, and a
process group of world size 1 runs the data-parallel path to the same update as one process."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import private_engine as pe
from dist_spawn import free_port
from private_engine.data import poisson_loader

pytestmark = pytest.mark.slow


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _engine(model, **kwargs):
    return pe.PrivacyEngine(model, batch_size=8, sample_size=64, max_grad_norm=0.1,
                            noise_multiplier=0.0, **kwargs)


@pytest.fixture
def no_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")


def test_distributed_true_needs_a_process_group(no_group):
    with pytest.raises(ValueError, match="init_process_group"):
        _engine(_mlp(), distributed=True)
    with pytest.raises(ValueError, match="init_process_group"):
        poisson_loader(TensorDataset(torch.arange(10)), 2, distributed=True)
    with pytest.raises(TypeError, match="distributed"):
        _engine(_mlp(), distributed="yes")


def test_default_is_one_process(no_group):
    engine = _engine(_mlp(), check_replicas=True)  # check_replicas: nothing to compare
    assert engine.distributed is None and engine.draws_noise
    assert engine.noise_generator is not None
    opt = engine.attach(torch.optim.SGD(engine.model.parameters(), lr=0.5))
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    opt.step(loss=F.cross_entropy(engine.model(x), y, reduction="none"))
    assert engine.steps_taken == 1


def test_world_of_one_runs_the_data_parallel_path(no_group):
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}",
                            timeout=timedelta(seconds=30))
    try:
        assert _engine(_mlp()).distributed is None  # None: only a group of W > 1
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        results = []
        for distributed in (True, False):
            model = _mlp()
            engine = _engine(model, distributed=distributed, check_replicas=True)
            assert (engine.distributed is not None) == distributed
            opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.5))
            opt.virtual_step(loss=F.cross_entropy(model(x[:3]), y[:3], reduction="none"))
            opt.step(loss=F.cross_entropy(model(x[3:]), y[3:], reduction="none"))
            results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert torch.allclose(results[0], results[1], atol=1e-12, rtol=0)
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_a_world_of_one_trains_like_one_process(tmp_path):
    """FSDP2's fully_shard on a one-process gloo group: the engine takes the sharded path (the
    shards are the whole parameters, DTensors) and reaches the unsharded model's update, with
    accumulation; distributed=False is refused (a sharded model needs its process group)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("no FSDP2 in this torch")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        results = []
        for sharded in (True, False):
            model = _mlp()
            if sharded:
                fsdp.fully_shard(model[0])
                fsdp.fully_shard(model)
            engine = _engine(model)
            assert engine.sharded == sharded
            opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.5))
            opt.virtual_step(loss=F.cross_entropy(model(x[:3]), y[:3], reduction="none"))
            opt.step(loss=F.cross_entropy(model(x[3:]), y[3:], reduction="none"))
            results.append(torch.cat([getattr(p, "full_tensor", lambda p=p: p)().detach().flatten()
                                      for p in model.parameters()]))
        assert type(next(_fsdp_params(fsdp))).__name__ == "DTensor"
        assert (results[0] - _flat_initial()).abs().max() > 1e-3
        assert torch.allclose(results[0], results[1], atol=1e-12, rtol=0)
        with pytest.raises(ValueError, match="distributed=False"):
            _engine(fsdp.fully_shard(_mlp()), distributed=False)
    finally:
        dist.destroy_process_group()


def _fsdp_params(fsdp):
    model = _mlp()
    fsdp.fully_shard(model)
    return model.parameters()


def _flat_initial():
    return torch.cat([p.detach().flatten() for p in _mlp().parameters()])
