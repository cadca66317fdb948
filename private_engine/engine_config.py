"""The arguments of :class:`private_engine.PrivacyEngine`, checked once: :class:`EngineConfig`.

Every check a configuration can fail without the model (sizes, the privacy parameters, the
clipping mode and its loss scaling) raises here, with the message that names the argument and
what to pass; the engine checks what needs the model or the process group itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union, cast

import torch

from .accounting import ACCOUNTANTS, calibrate_noise_multiplier, steps_for
from .clipping.functions import ClipFn
from .clipping.plan import DEFAULT_CLIPPING_MODE, check_mode, is_book_keeping


def check_max_grad_norm(value: Any) -> float:
    """R as a float: a finite number ``0 < R < ∞`` (``ValueError`` otherwise)."""
    if not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {value!r}.")
    return float(value)


@dataclass
class EngineConfig:
    """The keyword arguments of :class:`private_engine.PrivacyEngine` (its docstring says what
    each means), validated in ``__post_init__``."""

    batch_size: Optional[int] = None
    sample_size: Optional[int] = None
    max_grad_norm: Optional[float] = None
    epochs: Optional[float] = None
    steps: Optional[int] = None
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    clipping_mode: str = DEFAULT_CLIPPING_MODE
    clipping_fn: Union[str, ClipFn] = "abadi"
    accountant: str = "rdp"
    noise_generator: Optional[torch.Generator] = None
    secure_mode: bool = False
    data_free_buffers: Sequence[str] = ()
    grad_scaler: Optional["torch.amp.GradScaler"] = None
    dynamic_loss_scale: bool = False
    allow_overrun: bool = False
    distributed: Optional[bool] = None
    check_replicas: bool = False
    check_sampling: bool = True
    data_loader: Any = None
    step_logger: Any = None

    def __post_init__(self) -> None:
        batch_size, sample_size = self.batch_size, self.sample_size
        if not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if not (isinstance(sample_size, int) and sample_size >= batch_size):
            raise ValueError(
                f"sample_size must be an integer ≥ batch_size ({batch_size}), got {sample_size!r}."
            )
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier or target_epsilon.")
        check_mode(self.clipping_mode)
        scaler = self.grad_scaler
        scaled = isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
        if scaled and not is_book_keeping(self.clipping_mode):
            raise ValueError(
                "grad_scaler needs a book-keeping clipping_mode ('bk', 'bk_mixed' or "
                f"'bk_mixopt'), not "
                f"{self.clipping_mode!r}: the two-pass modes would backpropagate a float16 graph "
                "in which samples overflowed twice; book-keeping runs one backward and drops "
                "each overflowing sample alone."
            )
        check_max_grad_norm(self.max_grad_norm)
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}.")
        sigma = self.noise_multiplier
        if sigma is not None and (sigma < 0 or not math.isfinite(sigma)):
            raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {sigma}.")

    @property
    def sample_rate(self) -> float:
        """q = B / n."""
        return cast(int, self.batch_size) / cast(int, self.sample_size)

    @property
    def delta(self) -> float:
        """δ: ``target_delta``, by default ``1 / (2n)``."""
        if self.target_delta is not None:
            return float(self.target_delta)
        return 1.0 / (2 * cast(int, self.sample_size))

    def noise(self) -> Tuple[float, Optional[int]]:
        """``(σ, planned steps)``: σ calibrated so that the planned steps (from ``epochs`` or
        ``steps``) spend exactly ``target_epsilon`` at δ, or the given ``noise_multiplier``
        (planned steps None unless ``epochs`` or ``steps`` is given)."""
        q = self.sample_rate
        if self.target_epsilon is not None:
            steps = steps_for(self.epochs, self.steps, q)
            return calibrate_noise_multiplier(self.target_epsilon, self.delta, q, steps,
                                              self.accountant), steps
        planned = steps_for(self.epochs, self.steps, q) if (self.epochs or self.steps) else None
        return float(cast(float, self.noise_multiplier)), planned


__all__ = ["EngineConfig", "check_max_grad_norm"]
