"""The engine's own arithmetic runs with autocast off.

Its per-sample norms and clipped sums are formed in the backward pass (tensor hooks) and in the
optimizer's step, so a training step written inside ``with torch.autocast(...)`` would run them
under the caller's autocast: ``torch.mm``, ``torch.bmm`` and the convolutions of float32 operands
would then round their operands and results to bfloat16/float16, far beyond the float32 rounding
that every certified bound assumes (:mod:`private_engine.layers.rounding`,
:mod:`private_engine.layers.gram`). The operands autocast gave the layers are recorded as they were
(:func:`private_engine.capture.recorder.autocast_operand`); only how the engine combines them is
kept out of autocast.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

#: device types whose autocast state is switched off
_DEVICES = ("cpu", "cuda")


def autocast_off() -> contextlib.ExitStack:
    """A context in which autocast is off on every device type where it is on now (nothing is
    entered where it is off: no warning for a device type this machine lacks)."""
    stack = contextlib.ExitStack()
    for device in _DEVICES:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def without_autocast(fn: F) -> F:
    """``fn`` run inside :func:`autocast_off`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with autocast_off():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
