"""Activation checkpointing (``torch.utils.checkpoint``) under the clipping backward: torch's
errors turned into a refusal that names the cause and the fix."""
from __future__ import annotations

import contextlib

from torch.utils.checkpoint import CheckpointError

_OFF = ("or switch checkpointing off for private training (timm: "
        "model.set_grad_checkpointing(False); Hugging Face: "
        "model.gradient_checkpointing_disable())")


@contextlib.contextmanager
def explain_activation_checkpointing():
    """Re-raise torch's activation-checkpointing failures inside the clipping backward as a
    ``ValueError`` that says why and what to change; anything else passes unchanged.

    * ``use_reentrant=True``: the recomputation runs its own ``backward()``, which torch forbids
      inside the ``torch.autograd.grad`` the engine's norm and clipping passes use.
    * ``use_reentrant=False``: the recomputed forward must save the same tensors as the first; a
      parameter clipped by the parameter-entry tracer (or a module on the ``torch.func``
      fallback) is expanded per sample in the engine's forward but not in torch's recomputation,
      so the saved tensors differ (``CheckpointError``).
    """
    try:
        yield
    except CheckpointError as err:
        raise ValueError(
            "activation checkpointing (torch.utils.checkpoint) recomputes the forward of a block "
            "that uses a parameter clipped by the parameter-entry tracer (a raw parameter such as "
            "a cls_token, a LayerScale gamma, a weight in x @ W) or by the torch.func fallback: "
            "the engine expands such parameters per sample in the forward, torch's recomputation "
            "does not, and the tensors saved for the backward differ. Fix: checkpoint only "
            "blocks made of layers with rules (Linear, Conv, Embedding, LayerNorm, GroupNorm), "
            f"{_OFF}. Nothing was updated.") from err
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise ValueError(
            "activation checkpointing with use_reentrant=True runs its own backward() inside the "
            "engine's torch.autograd.grad, which torch does not allow. Fix: pass "
            "use_reentrant=False to torch.utils.checkpoint.checkpoint (and keep parameters "
            f"clipped by the parameter-entry tracer out of the checkpointed blocks), {_OFF}. "
            "Nothing was updated.") from err


__all__ = ["explain_activation_checkpointing"]
