"""Shared checks for the engine tests: engine vs the float64 sample-by-sample reference.

Every check builds a float64 model, computes the reference per-sample norms by looping over
samples (tests/reference.py), picks the clipping threshold R in the middle of the norms (so
that some samples are clipped and others are not, and no norm sits near R), and compares

* ``engine.clipped_grad_sum(loss)`` with the reference clipped sum,
* ``engine.last_norms`` with the reference norms,
* a full ``optimizer.step(loss=...)`` (noise 0, SGD lr=1) with ``θ − (reference sum)/B``.
"""
from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

import torch
from torch import nn

import private_engine as pe
from reference import assert_close_rel, reference_clipped_sum

#: float64 models and data: anything computed in float32 inside the engine would miss this by far
RTOL = 1e-9
MODES = ("mixed", "ghost", "per_sample", "bk", "bk_mixed", "bk_mixopt")
CLIPS = ("abadi", "automatic", "global", "custom")


# -- clip functions written out independently of the engine (seed 002, eq. 2.1) ----------------
def ref_abadi(norms, R):
    return torch.clamp(R / (norms + 1e-6), max=1.0)


def ref_automatic(norms, R):
    return R / (norms + 0.01)


def ref_global(norms, R):
    return (norms < R).to(norms.dtype)


def tanh_clip(norms, R):
    """A custom (user) clip function: C_i = R·tanh(‖g_i‖/R)/‖g_i‖ ≤ R/‖g_i‖ (smooth, never above
    R)."""
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    return torch.where(norms > 0, R * torch.tanh(norms / R) / safe, torch.ones_like(norms))


REF_CLIP = {"abadi": ref_abadi, "automatic": ref_automatic, "global": ref_global,
            "custom": tanh_clip}
ENGINE_CLIP = {"abadi": "abadi", "automatic": "automatic", "global": "global", "custom": tanh_clip}


def quadratic_loss(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A per-sample loss whose output gradient depends on the sample: Σ (t·y + y²/2)."""
    y = model(x)
    return (t * y + 0.5 * y * y).flatten(1).sum(1)


def target_like(model: nn.Module, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    with torch.no_grad():
        shape = model(x).shape
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def pick_threshold(norms: torch.Tensor) -> float:
    """R between the two middle norms: about half the samples clipped, none within 1e-3 of R."""
    s = torch.sort(norms.double()).values
    k = max(len(s) // 2 - 1, 0)
    lo, hi = float(s[k]), float(s[min(k + 1, len(s) - 1)])
    assert hi > 0, "all per-sample norms are zero: the case tests nothing"
    # samples with a zero gradient (e.g. all padding): R below the smallest positive norm
    if lo == 0:
        return hi * 0.5
    if hi / lo < 1.002:  # a tie in the middle: go below the smallest instead
        return float(s[0]) * 0.5 if s[0] > 0 else hi * 0.5
    return (lo * hi) ** 0.5


def trainable_names(model: nn.Module):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def make_engine(model: nn.Module, batch_size: int, *, mode: str = "mixed", clip="abadi",
                R: float = 1.0, noise_multiplier: float = 0.0, **kwargs) -> pe.PrivacyEngine:
    return pe.PrivacyEngine(model, batch_size=batch_size, sample_size=10 * batch_size,
                            max_grad_norm=R, noise_multiplier=noise_multiplier, clipping_mode=mode,
                            clipping_fn=clip, **kwargs)


def check_against_reference(model: nn.Module, inputs: Sequence[torch.Tensor],
                            loss_fn: Callable = quadratic_loss, *, mode: str, clip: str,
                            rtol: float = RTOL, check_step: bool = True,
                            R: Optional[float] = None) -> pe.PrivacyEngine:
    """Engine clipped sum, norms and SGD step vs the float64 reference; returns the engine."""
    B = inputs[0].shape[0]
    names = trainable_names(model)
    if R is None:
        _, norms = reference_clipped_sum(model, inputs, loss_fn, 1.0, ref_abadi)
        R = pick_threshold(norms)
    ref_sum, ref_norms = reference_clipped_sum(model, inputs, loss_fn, R, REF_CLIP[clip])

    engine = make_engine(model, B, mode=mode, clip=ENGINE_CLIP[clip], R=R)
    params = [p for p in model.parameters() if p.requires_grad]
    grads, n = engine.clipped_grad_sum(loss_fn(model, *inputs))
    assert n == B
    assert all(p.grad is None for p in params), "the clipping passes must not accumulate .grad"
    assert_close_rel(grads, ref_sum, rtol, names)
    assert_close_rel([engine.last_norms], [ref_norms], rtol, ["per-sample norms"])
    for d in engine.layer_plan:
        if mode == "ghost":
            assert d.use_ghost == d.ghost_capable, d
        elif mode == "per_sample":
            assert not d.use_ghost, d

    if check_step:
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.attach(opt)
        before = [p.detach().clone() for p in params]
        opt.step(loss=loss_fn(model, *inputs))
        assert_close_rel([p.detach() - b for p, b in zip(params, before)],
                         [-r / B for r in ref_sum], rtol, names)
        with torch.no_grad():  # leave the model as it was for the caller
            for p, b in zip(params, before):
                p.copy_(b)
                p.grad = None
        engine.detach()
    else:
        engine.detach()
    assert not any(m._forward_hooks for m in model.modules()), "detach must remove every hook"
    return engine


def rng_for(*key) -> random.Random:
    return random.Random(repr(key))


def gen_for(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
