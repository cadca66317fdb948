"""``private_logical_step(..., lockstep=True)`` on an FSDP2-sharded model, world size 2 (gloo,
CPU): ranks whose batches split into different numbers of physical chunks (5 samples in chunks of
2 on rank 0: three chunks; an empty batch on rank 1) run the same number of forwards, and the
update equals one unsharded process stepping on all the samples (noise 0, float64, 1e-6). Without
lockstep the forwards' collectives would not match."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from dist_spawn import run_ranks
from private_engine.training import private_logical_step

pytestmark = pytest.mark.slow

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("no FSDP2 in this torch", allow_module_level=True)

B, R = 5, 0.1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,),
                                                                               generator=g)


def _engine(model):
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0)
    return engine, engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))


def _loss(model):
    return lambda x, y: F.cross_entropy(model(x), y, reduction="none")


def lockstep_worker(rank, out_dir):
    from torch.distributed.tensor import DTensor

    model = _model()
    fsdp.fully_shard(model[0])
    fsdp.fully_shard(model[2])
    fsdp.fully_shard(model)
    _, opt = _engine(model)
    x, y = _data()
    mine = (x, y) if rank == 0 else (x[:0], y[:0])
    private_logical_step(opt, mine, _loss(model), physical_batch_size=2, lockstep=True)
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                      for p in model.parameters()])


def test_lockstep_chunks_on_fsdp2_equal_one_process(tmp_path):
    sharded = run_ranks(lockstep_worker, tmp_path)
    model = _model()
    _, opt = _engine(model)
    private_logical_step(opt, _data(), _loss(model), physical_batch_size=2)
    single = torch.cat([p.detach().flatten() for p in model.parameters()])
    for params in sharded:
        assert float((params - single).abs().max()) <= 1e-6


def misuse_worker(rank, out_dir):
    """What a user may do wrong under FSDP2, on each rank."""
    import warnings

    from torch.distributed.tensor import DTensor

    warnings.simplefilter("ignore")

    def shard(m):
        fsdp.fully_shard(m[0])
        fsdp.fully_shard(m[2])
        fsdp.fully_shard(m)
        return m

    res = {}
    x, y = _data()
    sl = slice(0, 2) if rank == 0 else slice(2, 5)
    # a raw backward of the user's while attached: dropped, never reduced after detach
    model = shard(_model())
    engine, opt = _engine(model)
    loss = F.cross_entropy(model(x[sl]), y[sl], reduction="none")
    loss.sum().backward(retain_graph=True)
    opt.step(loss=loss)
    engine.detach()
    opt.zero_grad()
    (model(x[sl]) * 0.0).sum().backward()  # a later non-private phase whose loss is 0
    res["grads_after_detach"] = [0.0 if p.grad is None else float(p.grad.full_tensor().norm())
                                 for p in model.parameters()]
    # FSDP2's reshard after backward switched back on: refused at the step, nothing updated
    model = shard(_model())
    engine, opt = _engine(model)
    model.set_reshard_after_backward(True)
    before = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    try:
        opt.step(loss=F.cross_entropy(model(x[sl]), y[sl], reduction="none"))
        res["reshard"] = "stepped"
    except RuntimeError as e:
        res["reshard"] = str(e)
    after = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    res["reshard_changed"] = float((after - before).abs().max())
    # a bfloat16 model with an empty batch on one rank: the ranks' sums have one dtype
    torch.manual_seed(0)
    model = shard(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.bfloat16))
    engine, opt = _engine(model)
    xs = x.to(torch.bfloat16)[:0] if rank == 0 else x.to(torch.bfloat16)
    ys = y[:0] if rank == 0 else y
    opt.step(loss=F.cross_entropy(model(xs).float(), ys, reduction="none"))
    res["bf16"] = all(isinstance(p, DTensor) for p in model.parameters())
    return res


def test_fsdp2_misuse_is_contained(tmp_path):
    for res in run_ranks(misuse_worker, tmp_path):
        assert res["grads_after_detach"] == [0.0] * 4, res
        assert "reshard after backward" in res["reshard"] and res["reshard_changed"] == 0.0, res
        assert res["bf16"]
