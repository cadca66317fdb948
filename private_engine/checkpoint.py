"""Native checkpoints: the engine's state, and model + optimizer + engine in one file, atomically.

A run killed at any physical batch and resumed from the last checkpoint ends with the same
parameters, bit for bit, and the same ε as an uninterrupted run, provided the data order is
restored as well (pass the loader's generator state through ``extra``). What the engine saves
(:func:`engine_state_dict`, also ``PrivacyEngine.state_dict()``):

* the accountant (its name and ``history`` of ``(σ, q, steps)``), and the privacy parameters the
  history was spent under (σ, q, R, batch size, sample size, target ε and δ, planned steps,
  secure mode, loss scaling); loading into an engine built with other ones raises a ValueError
  naming each difference, before anything changes;
* the noise generator's state (``engine.noise_generator.get_state()``; None in secure mode);
* the logical batch being accumulated (``virtual_step``) by every attached optimizer: its clipped
  sums per parameter (copies) and its sample count;
* the loss scaling (the GradScaler's ``state_dict()`` and the engine's counters), the sampling-rate
  check's totals and ``dropped_samples``.

**A checkpoint is as secret as the training data.** Whoever reads the generator state can
regenerate the noise of every step drawn from it, earlier ones included (MT19937's transition can
be run backwards; Philox is a counter), and subtract it from the released updates; the accumulation
in progress is a sum of clipped gradients *before* its noise; the counters are functions of the
Poisson batch sizes; and a loader state in ``extra`` reveals the batches themselves. Keep
checkpoints where the data is kept (files are written readable by their owner only, mode 0600)
and delete them with it. A checkpoint taken right after ``optimizer.step()`` holds no
accumulation; an engine in secure mode holds no generator state (its resumed noise is fresh).

Data-parallel training (``engine.distributed``): the noise generator is rank 0's (the other ranks
draw no noise and hold none), so :func:`save_checkpoint` writes on rank 0 only and the other ranks
return without writing; :func:`load_checkpoint` runs on every rank, and only rank 0 restores the
generator state. A rank's accumulation in progress is its own, so a data-parallel checkpoint is
taken between logical batches (right after ``optimizer.step()``); one with an accumulation in
progress is refused.

The dicts hold tensors and plain Python values only, so ``torch.load(..., weights_only=True)``
reads them; :func:`load_checkpoint` does. This module does not import the engine (the engine
delegates to it).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .clipping.grad_sums import GradSums

#: format tag and version of :func:`engine_state_dict`
ENGINE_FORMAT = "private_engine.PrivacyEngine"
#: format tag and version of the files of :func:`save_checkpoint`
CHECKPOINT_FORMAT = "private_engine.checkpoint"
VERSION = 1

#: the privacy parameters compared on load: (key, how to read it from the engine)
_PARAMETERS = (
    ("noise_multiplier", lambda e: float(e.noise_multiplier)),
    ("max_grad_norm", lambda e: float(e.max_grad_norm)),
    ("sample_rate", lambda e: float(e.sample_rate)),
    ("batch_size", lambda e: int(e.batch_size)),
    ("sample_size", lambda e: int(e.sample_size)),
    ("target_epsilon", lambda e: _optional_float(e.target_epsilon)),
    ("target_delta", lambda e: float(e.target_delta)),
    ("steps", lambda e: None if getattr(e, "steps", None) is None else int(e.steps)),
    ("accountant", lambda e: str(e.accountant_name)),
    ("secure_mode", lambda e: bool(e.secure_mode)),
    ("grad_scaler", lambda e: bool(e.loss_scaling.enabled)),
    ("dynamic_loss_scale", lambda e: bool(e.loss_scaling.enabled and e.loss_scaling.dynamic)),
)


def _optional_float(x) -> Optional[float]:
    return None if x is None else float(x)


# -- the engine's state ----------------------------------------------------------------------------
def engine_state_dict(engine) -> Dict[str, Any]:
    """The state of a :class:`private_engine.PrivacyEngine` that a resumed run needs, as a dict of
    tensors and plain Python values (``torch.save`` it; ``torch.load(weights_only=True)`` reads it):

    ``privacy`` (σ, R, q, batch and sample size, target ε and δ, planned steps, accountant, secure
    mode, loss scaling: checked on load), ``accountant`` (name and ``history`` of ``(σ, q,
    steps)``), ``noise_generator`` (the generator's ``get_state()``, None in secure mode),
    ``accumulation`` (per attached optimizer, in attach order: None, or the running clipped sums of
    the logical batch being accumulated, one copied tensor per parameter, and its sample count),
    ``loss_scaling`` (None, or the GradScaler's ``state_dict()`` and the engine's overflow
    counters),
    ``sampling_check`` (released batches and their samples) and ``dropped_samples``.

    Secret: the generator state lets its reader regenerate the noise of every step drawn from it
    (earlier ones too), and the accumulation is a sum of clipped gradients not yet noised. Keep
    the result as private as the training data (module docstring).
    """
    generator = engine.noise_generator
    _check_no_distributed_accumulation(engine)
    accumulation: List[Optional[Dict[str, Any]]] = []
    for step in _attached_steps(engine):
        if step.grad_sums is None:
            accumulation.append(None)
        else:
            grads = [g.detach().clone() for g in step.grad_sums.grads]
            accumulation.append({"grads": grads, "samples": int(step.samples)})
    check = getattr(engine, "sampling_check", None)
    return {
        "format": ENGINE_FORMAT,
        "version": VERSION,
        "privacy": {key: read(engine) for key, read in _PARAMETERS},
        "accountant": {
            "name": str(engine.accountant_name),
            "history": [(float(s), float(q), int(n)) for s, q, n in engine.accountant.history],
        },
        "noise_generator": None if generator is None else generator.get_state(),
        "noise_generator_device": None if generator is None else generator.device.type,
        "accumulation": accumulation,
        "loss_scaling": _loss_scaling_state(engine.loss_scaling),
        "sampling_check": None if check is None else {"steps": int(check.steps),
                                                      "samples": int(check.samples)},
        "dropped_samples": int(engine.dropped_samples),
        "clipping_mode": str(engine.clipping_mode),
    }


def check_engine_state_dict(engine, state: Dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``state`` (from :func:`engine_state_dict`) cannot be loaded into
    ``engine``: another format, privacy parameters that differ from the engine's (each difference
    named), a generator of another kind, an accumulation for an optimizer that is not attached, or
    sums whose shapes are not the parameters'. Changes nothing."""
    if not isinstance(state, dict) or state.get("format") != ENGINE_FORMAT:
        raise ValueError("not a private_engine engine state (engine.state_dict()).")
    if state.get("version") != VERSION:
        raise ValueError(f"engine state version {state.get('version')!r} is not supported "
                         f"(this private_engine reads version {VERSION}).")
    saved = state["privacy"]
    mine = {key: read(engine) for key, read in _PARAMETERS}
    diffs = [f"{key}: checkpoint {saved.get(key)!r}, engine {value!r}"
             for key, value in mine.items() if saved.get(key) != value]
    if diffs:
        hint = ""
        if any(d.startswith("max_grad_norm") for d in diffs):
            hint = (" (if R was changed during training, set engine.max_grad_norm to the "
                    "checkpoint's before loading)")
        raise ValueError(
            "the checkpoint was written under other privacy parameters than this engine's: "
            + "; ".join(diffs) + ". Its accountant history and noise are only valid under its "
            "own; build the engine with the checkpoint's parameters" + hint + ".")
    generator = engine.noise_generator
    if state["noise_generator"] is not None and _draws_noise(engine):
        if generator is None:
            raise ValueError("the checkpoint holds a noise generator state but the engine has "
                             "no generator (secure mode).")
        if state.get("noise_generator_device") != generator.device.type:
            raise ValueError(
                f"the checkpoint's noise generator is a {state.get('noise_generator_device')} "
                f"generator, the engine's a {generator.device.type} one: build the engine with "
                "its model on the same kind of device.")
    steps = _attached_steps(engine)
    for k, acc in enumerate(state["accumulation"]):
        if acc is None:
            continue
        if _distributed(engine):
            raise ValueError("the checkpoint holds an accumulation in progress, which a "
                             "data-parallel engine cannot load: each rank accumulates its own "
                             "samples. Checkpoint right after optimizer.step().")
        if k >= len(steps):
            raise ValueError(
                f"the checkpoint holds an accumulation in progress for attached optimizer #{k} "
                f"but the engine has {len(steps)} attached: attach the optimizer(s) "
                "(engine.attach) before loading.")
        grads = acc["grads"]
        shapes = [tuple(p.shape) for p in engine.params]
        if [tuple(g.shape) for g in grads] != shapes:
            raise ValueError("the checkpoint's accumulated sums do not have the shapes of the "
                             "engine's trainable parameters (another model?).")
    if (state["loss_scaling"] is None) != (not engine.loss_scaling.enabled):
        raise ValueError("the checkpoint and the engine differ in loss scaling (grad_scaler).")


def load_engine_state_dict(engine, state: Dict[str, Any]) -> None:
    """Restore ``engine`` from ``state`` (:func:`engine_state_dict`), after
    :func:`check_engine_state_dict` (a ValueError leaves the engine unchanged): the accountant's
    history, the noise generator's state, each attached optimizer's accumulation in progress
    (rebuilt as :meth:`GradSums.separate` on the parameters' devices; later physical batches add to
    it per parameter), the loss scaling, the sampling-rate check and ``dropped_samples``."""
    check_engine_state_dict(engine, state)
    engine.accountant.history = [(float(s), float(q), int(n))
                                 for s, q, n in state["accountant"]["history"]]
    if state["noise_generator"] is not None and _draws_noise(engine):
        engine.noise_generator.set_state(state["noise_generator"].cpu())
    steps = _attached_steps(engine)
    for k, step in enumerate(steps):
        acc = state["accumulation"][k] if k < len(state["accumulation"]) else None
        if acc is None:
            step.grad_sums, step.samples = None, 0
        else:
            grads = [g.to(device=p.device, copy=True)
                     for g, p in zip(acc["grads"], engine.params)]
            step.grad_sums, step.samples = GradSums.separate(grads), int(acc["samples"])
    _load_loss_scaling(engine.loss_scaling, state["loss_scaling"])
    check = getattr(engine, "sampling_check", None)
    if check is not None and state.get("sampling_check") is not None:
        check.steps = int(state["sampling_check"]["steps"])
        check.samples = int(state["sampling_check"]["samples"])
    engine.dropped_samples = int(state["dropped_samples"])


def _distributed(engine) -> bool:
    """Whether ``engine`` trains data-parallel (:mod:`private_engine.optim.distributed`)."""
    return getattr(engine, "distributed", None) is not None


def _draws_noise(engine) -> bool:
    """Whether ``engine``'s process draws the noise (one process, or rank 0): only there does a
    generator state belong."""
    return getattr(engine, "draws_noise", True)


def _check_no_distributed_accumulation(engine) -> None:
    """Refuse to save a data-parallel engine's state in the middle of a logical batch: the
    accumulation in progress is this rank's alone, and a checkpoint holds one rank's state."""
    if _distributed(engine) and any(s.grad_sums is not None for s in _attached_steps(engine)):
        raise ValueError("a data-parallel checkpoint cannot be taken while a logical batch is "
                         "being accumulated (virtual_step): each rank holds its own partial "
                         "sums. Checkpoint right after optimizer.step().")


def _attached_steps(engine) -> list:
    """The engine's attached :class:`private_engine.optim.PrivateStep` objects, in attach order."""
    return [s for s in engine._attached if s.attached]


def _loss_scaling_state(ls) -> Optional[Dict[str, Any]]:
    if not ls.enabled:
        return None
    return {"scaler": ls.scaler.state_dict(), "dynamic": bool(ls.dynamic),
            "good_batches": int(ls._good_batches), "overflow_batches": int(ls.overflow_batches),
            "dropped_samples": int(ls.dropped_samples)}


def _load_loss_scaling(ls, state: Optional[Dict[str, Any]]) -> None:
    if state is None:
        return
    ls.scaler.load_state_dict(state["scaler"])
    ls._good_batches = int(state["good_batches"])
    ls.overflow_batches = int(state["overflow_batches"])
    ls.dropped_samples = int(state["dropped_samples"])


# -- files -----------------------------------------------------------------------------------------
def save_checkpoint(path, *, model: nn.Module, optimizer: torch.optim.Optimizer, engine,
                    extra: Any = None) -> None:
    """Write ``model``'s and ``optimizer``'s ``state_dict()``, the engine's state
    (:func:`engine_state_dict`: accountant, privacy parameters, noise generator state, the
    accumulation in progress, counters) and ``extra`` (anything of yours: the data loader's
    generator state and the position in the epoch, a scheduler's state) to ``path``, atomically.

    ``optimizer`` must be attached to ``engine`` (its logical batch in progress is saved through
    the engine). The file is written to a temporary file in the same directory (mode 0600),
    flushed and ``fsync``-ed, then renamed over ``path`` (``os.replace``): a crash or an error
    mid-write leaves the previous checkpoint intact (a stale ``.<name>.*.tmp`` file may remain
    after a crash; it is as secret as a checkpoint). ``extra`` should hold tensors and plain
    Python values, as :func:`load_checkpoint` reads with ``weights_only=True`` (register other
    types with ``torch.serialization.add_safe_globals``).

    Data-parallel (``engine.distributed``): every rank may call it; only rank 0 writes (the
    others check that they hold no accumulation in progress and return). Call
    ``torch.distributed.barrier()`` before other ranks read the file.

    Secret: the file holds the noise generator's state and un-noised clipped sums; keep it as
    private as the training data.
    """
    _refuse_sharded(engine)
    _check_attached(engine, optimizer)
    _check_model(engine, model)
    if _distributed(engine) and not _draws_noise(engine):
        _check_no_distributed_accumulation(engine)
        return  # rank 0 writes: its generator is the noise's
    checkpoint = {
        "format": CHECKPOINT_FORMAT,
        "version": VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "engine": engine_state_dict(engine),
        "extra": extra,
    }
    atomic_save(checkpoint, path)


def load_checkpoint(path, *, model: nn.Module, optimizer: torch.optim.Optimizer, engine) -> Any:
    """Restore ``model``, ``optimizer`` and ``engine`` from a file of :func:`save_checkpoint` and
    return its ``extra``.

    Build the model, the optimizer and the engine as for the original run (same privacy
    parameters; same noise generator kind) and attach the optimizer first. The file is read with
    ``torch.load(weights_only=True, map_location="cpu")`` and the tensors go to the parameters'
    devices. A checkpoint of other privacy parameters raises ``ValueError`` naming them before
    anything changes. Data-parallel: every rank loads rank 0's file; only rank 0 restores the
    noise generator. Secret: see :func:`save_checkpoint`.
    """
    _refuse_sharded(engine)
    _check_attached(engine, optimizer)
    _check_model(engine, model)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a private_engine checkpoint "
                         "(private_engine.save_checkpoint).")
    if checkpoint.get("version") != VERSION:
        raise ValueError(f"checkpoint version {checkpoint.get('version')!r} is not supported "
                         f"(this private_engine reads version {VERSION}).")
    check_engine_state_dict(engine, checkpoint["engine"])  # before anything changes
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    load_engine_state_dict(engine, checkpoint["engine"])
    return checkpoint["extra"]


def atomic_save(obj: Any, path) -> None:
    """``torch.save(obj, path)`` so that ``path`` holds either its old content or the whole new
    one: written to a temporary file of mode 0600 in the same directory, flushed and ``fsync``-ed,
    renamed over ``path`` (``os.replace``, atomic on POSIX and Windows), then the directory
    ``fsync``-ed where the OS allows. The temporary file is removed if anything raises."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError, AttributeError):  # directories cannot be opened on Windows
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _refuse_sharded(engine) -> None:
    """Refuse an engine on an FSDP2 (``fully_shard``) model: its model and optimizer states are
    ``DTensor`` shards, one part per rank, and every rank's engine holds its own noise generator,
    so one file written by rank 0 would hold a fraction of the model. Save the shards with
    ``torch.distributed.checkpoint`` and ``engine.state_dict()`` on every rank instead."""
    if getattr(engine, "sharded", False):
        raise ValueError(
            "save_checkpoint / load_checkpoint do not handle FSDP2 (fully_shard) models: the "
            "model and optimizer states are shards, one part per rank, and each rank's engine "
            "holds its own noise generator. Save model and optimizer with "
            "torch.distributed.checkpoint (get_model_state_dict / get_optimizer_state_dict) and "
            "engine.state_dict() on every rank, each rank loading its own "
            "(docs/distributed.md, \"FSDP2\").")


def _check_attached(engine, optimizer) -> None:
    if not any(s.optimizer is optimizer for s in _attached_steps(engine)):
        raise ValueError("the optimizer is not attached to this engine (engine.attach(optimizer)): "
                         "its accumulation in progress is saved and restored through the engine.")


def _check_model(engine, model) -> None:
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for p in engine.params):
        raise ValueError("the model is not the engine's: its parameters do not include the "
                         "parameters the engine clips.")


__all__ = ["engine_state_dict", "check_engine_state_dict", "load_engine_state_dict",
           "save_checkpoint", "load_checkpoint", "atomic_save"]
