"""Data-parallel native engine, world size 2 (gloo, CPU): the update equals one process's.

With noise 0, two ranks holding B/2 samples each of a logical batch of B step every replica to
the parameters one process reaches on the whole batch (float64: to 1e-6), in each of the six
clipping modes, for an MLP, a CNN with GroupNorm and a tiny timm ViT (its ``cls_token`` and
``pos_embed`` clipped by the tracer); with gradient accumulation (``virtual_step``, physical
batches of different sizes per rank, an empty one); with all samples on one rank and none on the
other (different flat-buffer layouts on the two ranks). The two replicas are equal bit for bit. A
crafted sample (inputs ×1e4) on rank 1 moves the release by at most R: ``B·‖Δupdate‖/R ≤ 1``
(noise 0, SGD with learning rate 1).

Everything runs in one spawn of two ranks (the module fixture); each test checks what they
returned.
"""
from __future__ import annotations

import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from dist_spawn import run_ranks

pytestmark = pytest.mark.slow

MODES = pe.CLIPPING_MODES
MODELS = ("mlp", "cnn", "vit")
B, N, STEPS, R = 8, 64, 2, 0.1
TOL = 1e-6
CASES = [(name, mode, variant) for name in MODELS for mode in MODES
         for variant in ("split", "accumulate") + (("uneven",) if name == "mlp" else ())]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    elif name == "cnn":
        m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3))
    else:
        m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1,
                              embed_dim=16, num_heads=2, num_classes=3)
    return m.double()


def _batches(name: str, crafted: bool = False):
    """STEPS global batches of B samples (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    shape = {"mlp": (6,), "cnn": (3, 6, 6), "vit": (3, 16, 16)}[name]
    out = []
    for _ in range(STEPS):
        x = torch.randn(B, *shape, generator=g, dtype=torch.float64)
        if crafted:
            x[B - 1] *= 1e4
        out.append((x, torch.randint(0, 3, (B,), generator=g)))
    return out


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _engine(model, mode, distributed, lr=0.5, max_grad_norm=R):
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=max_grad_norm,
                              noise_multiplier=0.0, clipping_mode=mode, distributed=distributed)
    return engine, engine.attach(torch.optim.SGD(model.parameters(), lr=lr))


def _loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _pieces(rank: int, variant: str, n_local: int):
    """The physical batches (slices of the global batch) this rank runs in one logical batch."""
    if variant == "split":
        return [slice(rank * 4, rank * 4 + 4)]
    if variant == "uneven":
        return [slice(0, B)] if rank == 0 else [slice(0, 0)]
    # accumulate: rank 0 → [1, 3] samples; rank 1 → [2, (empty,) 2]
    if rank == 0:
        return [slice(0, 1), slice(1, 4)]
    return [slice(4, 6)] + ([slice(6, 6)] if n_local else []) + [slice(6, 8)]


def _run_distributed(rank, name, mode, variant):
    model = _model(name)
    _, opt = _engine(model, mode, True)
    for x, y in _batches(name):
        pieces = _pieces(rank, variant, name == "mlp")
        for k, sl in enumerate(pieces):
            loss = _loss(model, x[sl], y[sl])
            if k < len(pieces) - 1:
                opt.virtual_step(loss=loss)
            else:
                opt.step(loss=loss)
    return _flat(model)


def _run_single(name, mode):
    model = _model(name)
    _, opt = _engine(model, mode, False)
    for x, y in _batches(name):
        opt.step(loss=_loss(model, x, y))
    return _flat(model)


def _crafted_ratio(rank, name, mode):
    """B·‖update(with) − update(without)‖ / R, the crafted sample on rank 1 (noise 0, lr 1)."""
    updates = []
    for crafted_in in (True, False):
        model = _model(name)
        before = _flat(model)
        _, opt = _engine(model, mode, True, lr=1.0, max_grad_norm=1.0)
        x, y = _batches(name, crafted=True)[0]
        sl = slice(rank * 4, rank * 4 + 4 if (rank == 0 or crafted_in) else B - 1)
        opt.step(loss=_loss(model, x[sl], y[sl]))
        updates.append(_flat(model) - before)
    return float(B * (updates[0] - updates[1]).norm() / 1.0)


def equivalence_worker(rank, out_dir):
    warnings.simplefilter("ignore")
    out = {}
    for name, mode, variant in CASES:
        out[(name, mode, variant)] = _run_distributed(rank, name, mode, variant)
    for name in MODELS:
        for mode in MODES:
            if rank == 0:
                out[(name, mode, "single")] = _run_single(name, mode)
            out[(name, mode, "initial")] = _flat(_model(name))
    for name in ("mlp", "vit"):
        for mode in MODES:
            out[(name, mode, "crafted")] = _crafted_ratio(rank, name, mode)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(equivalence_worker, tmp_path_factory.mktemp("dist_equivalence"))


@pytest.mark.parametrize("name,mode,variant", CASES)
def test_two_ranks_equal_one_process(ranks, name, mode, variant):
    r0, r1 = ranks
    got0, got1 = r0[(name, mode, variant)], r1[(name, mode, variant)]
    assert torch.equal(got0, got1), "the replicas differ"
    want = r0[(name, mode, "single")]
    moved = (want - r0[(name, mode, "initial")]).abs().max()
    assert moved > 1e-3, "the reference did not move: the test would see nothing"
    assert (got0 - want).abs().max() <= TOL


@pytest.mark.parametrize("name", ["mlp", "vit"])
@pytest.mark.parametrize("mode", MODES)
def test_crafted_sample_moves_release_by_at_most_R(ranks, name, mode):
    ratio0, ratio1 = ranks[0][(name, mode, "crafted")], ranks[1][(name, mode, "crafted")]
    assert ratio0 == ratio1
    assert 0.5 < ratio0 <= 1.0 + 1e-9
