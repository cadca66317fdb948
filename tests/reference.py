"""Float64 reference for per-sample clipping: loop over samples one at a time (microbatches of
1)."""
from __future__ import annotations

import copy
from typing import Callable, List, Sequence, Tuple

import torch
from torch import nn


def reference_clipped_sum(model: nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable,
                          max_grad_norm: float,
                          clip_fn: Callable) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """``(Σ_i C_i ∂L_i/∂θ for trainable θ, norms)`` in float64, one sample per backward.

    ``inputs`` are batch-first tensors; ``loss_fn(model, *inputs_i) -> per-sample loss (1,)``.
    """
    ref = copy.deepcopy(model).double()
    params = [p for p in ref.parameters() if p.requires_grad]
    B = inputs[0].shape[0]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(B):
        xs = [x[i:i + 1].double() if x.is_floating_point() else x[i:i + 1] for x in inputs]
        loss = loss_fn(ref, *xs).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(norm)
        c = clip_fn(norm.reshape(1), max_grad_norm)[0]
        for t, g in zip(total, grads):
            t.add_(c * g)
    return total, torch.stack(norms)


def assert_close_rel(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
                     rtol: float = 1e-6, names: Sequence[str] = ()) -> None:
    """Relative error ‖a − e‖ / max(‖e‖, tiny) ≤ rtol for every tensor pair (compared in
    float64)."""
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        a, e = a.double(), e.double()
        err = (a - e).norm().item()
        scale = max(e.norm().item(), 1e-12)
        name = names[k] if k < len(names) else str(k)
        assert err / scale <= rtol, (f"{name}: relative error {err / scale:.3e} > {rtol:.0e} "
                                     f"(|e|={scale:.3e})")
