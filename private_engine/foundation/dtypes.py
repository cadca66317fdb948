"""Generic dtype helpers: the accumulation and operand dtypes of the library's reductions and
matmuls, a cast that costs nothing when there is nothing to cast, and a cast of non-negative
factors rounded toward zero (a narrower dtype can only shrink them)."""
from __future__ import annotations

import torch


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """Norms are accumulated in at least float32 (float64 stays float64)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is (no dispatch: on a GPU a ``.to()`` that
    changes nothing still costs host time, and the rules call this a few times per layer per
    step)."""
    return t if t.dtype == dtype else t.to(dtype)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Operand dtype of a rule's matmuls for an output gradient ``t``: bfloat16 stays bfloat16
    (mixed precision: the matmuls run as autocast ran the layer, accumulating in float32 inside the
    kernel, and every norm is then accumulated in float32); float16 is widened to float32 (a
    loss-scaled float16 gradient would overflow in a Gram matrix); float64 stays float64; anything
    else is float32."""
    return torch.bfloat16 if t.dtype == torch.bfloat16 else accumulation_dtype(t)


def release_dtype(t: torch.Tensor) -> torch.dtype:
    """Operand dtype of a clipped sum formed from kept activations and gradients of dtype ``t``:
    16-bit operands stay 16-bit on CUDA (tensor cores, float32 accumulation and result,
    :func:`private_engine.foundation.matmul.wide_mm`) and are widened to float32 on the CPU (where
    the 16-bit kernels are no faster and round more: the factors are then applied in float32);
    float64 stays float64; anything else is float32."""
    dt = compute_dtype(t)
    if dt == torch.bfloat16 and t.device.type != "cuda":
        return torch.float32
    return dt


def cast_down(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative factors ``t`` in ``dtype``, rounded toward zero: every factor after the cast is
    ``≤`` the factor before, so a narrower dtype can only clip more, never less."""
    if t.dtype == dtype:
        return t
    low = t.to(dtype)
    if torch.finfo(dtype).bits >= torch.finfo(t.dtype).bits:
        return low
    up = low.to(t.dtype) > t
    return torch.where(up, torch.nextafter(low, torch.zeros_like(low)), low)
