"""Native checkpoints that are safe to publish and never replay a release.

The adversary of DP training sees every released iterate, checkpoint and log, those of a run that
was killed and resumed included. So a checkpoint holds only public values and values already
released with noise, a resumed run draws fresh noise, and ε counts every step the killed run may
have released, the ones after its last checkpoint included.

What a checkpoint holds (:func:`save_checkpoint`: the model's and the optimizer's
``state_dict()``, the engine's state of :func:`engine_state_dict`, and ``extra``), field by field:

* ``model``, ``optimizer``: the parameters and the optimizer's state (Adam's moments, momentum)
  are functions of the released noisy gradients: already public. The model's buffers are public
  too (:class:`private_engine.guards.buffers.BufferGuard` refuses a buffer written from the data).
* ``privacy``: σ, R, q, batch and sample size, target ε and δ, planned steps, accountant, secure
  mode, loss scaling: the declared parameters, public; loading into an engine built with other
  ones raises a ValueError naming each difference, before anything changes.
* ``accountant``: its name and ``history`` of ``(σ, q, steps)``: public (the number of steps is).
* ``ledger``: the step ledger's run identifier and path (public; see below).
* ``noise_generator``: None, unless the user gave the engine its ``noise_generator``: that run is
  reproducible from the generator by design (``ReproducibleNoiseWarning``), and its state is kept
  so that a resumed run continues the generator's stream rather than restarting it. **Not** the
  default generator's state: whoever read it could regenerate the noise of every step drawn from
  it (MT19937's transition can be run backwards; Philox is a counter), and a resumed run that
  restored it would draw the killed run's noise again on other batches, so that the difference of
  the two runs' iterates cancels the noise. A resumed run draws from the fresh
  :func:`private_engine.foundation.randomness.entropy_seeded_generator` its engine was built with
  (secure mode: from the OS generator, as always).
* ``loss_scaling``: the GradScaler's ``state_dict()`` when the scale is fixed (the scale the user
  chose, public); None with ``dynamic_loss_scale`` (its scale moves with which private samples
  overflowed): the resumed run starts from the scaler it was built with. The engine's overflow
  counters are not written.
* not written: the logical batch being accumulated (``virtual_step``: a sum of clipped gradients
  before its noise): :func:`save_checkpoint` and :func:`engine_state_dict` refuse to run while one
  is in progress; take checkpoints right after ``optimizer.step()``. The sampling-rate check's
  totals (sums of the Poisson batch sizes), ``dropped_samples`` and the loss-scaling counters
  (functions of the data): a resumed engine counts them from zero.
* ``extra`` is written as given: keep secrets out of it (a Poisson loader's generator state gives
  the batches away; the default :func:`private_engine.data.poisson_loader` needs none to resume,
  since each of its batches is drawn afresh).

**The step ledger** (:mod:`private_engine.accounting.ledger`): a small append-only file in which
the engine writes and ``fsync``-s one line per step before the step's update is applied. The first
:func:`save_checkpoint` of an engine without one creates it next to the checkpoint
(``<path>.ledger``; :func:`use_ledger` chooses another place, or starts it before the first step);
every later checkpoint names it. :func:`load_checkpoint` reads it and sets the accountant's history
to the ledger's, which extends the checkpoint's with the steps released after it: ε after a resume
counts every step the killed run released. A checkpoint whose ledger is missing, foreign or
shorter than its history is refused; ``ledger=False`` loads it with its own history, the caller
stating that nothing was released after it. A checkpoint of the older format (version 1, which
held the generator state and no ledger) loads its history only with ``ledger=False`` (its
generator state is not restored), and not at all if it was taken in the middle of a logical
batch. One fsync per step is the ledger's cost (docs/engine.md, "Checkpoints", has figures).

Data-parallel training (``engine.distributed``): :func:`save_checkpoint` writes on rank 0 only
(the other ranks check that they hold no accumulation and return), and rank 0 records the ledger;
:func:`load_checkpoint` runs on every rank and reads the same ledger (a shared file system). FSDP2
models are refused by :func:`save_checkpoint`; save the engine with the model and optimizer
through ``torch.distributed.checkpoint`` as :class:`EngineStateful` (after :func:`use_ledger` on
every rank, for a ledger), or ``engine.state_dict()`` on each rank.

The dicts hold tensors and plain Python values only, so ``torch.load(..., weights_only=True)``
reads them; :func:`load_checkpoint` does. The files are written atomically with mode 0600 (for
``extra``'s sake). This module does not import the engine (the engine delegates to it).
"""
from __future__ import annotations

import io
import logging
import os
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from .accounting.ledger import LEDGER_SUFFIX, LedgerContents, StepLedger, is_prefix, read_ledger
from .foundation.files import atomic_save

#: format tag and version of :func:`engine_state_dict`
log = logging.getLogger(__name__)

ENGINE_FORMAT = "private_engine.PrivacyEngine"
#: format tag and version of the files of :func:`save_checkpoint`
CHECKPOINT_FORMAT = "private_engine.checkpoint"
VERSION = 2
#: the version before the ledger (it held the generator state and the accumulation in progress)
_OLD_VERSION = 1
#: appended to a checkpoint's path for the ledger that :func:`save_checkpoint` creates

#: ``ledger=`` of the loaders: a path, None (the state's own) or False (none: nothing released
#: after the state)
LedgerArg = Union[None, bool, str, "os.PathLike[str]"]

#: the privacy parameters compared on load: (key, how to read it from the engine)
_PARAMETERS = (
    ("noise_multiplier", lambda e: float(e.noise_multiplier)),
    ("max_grad_norm", lambda e: float(e.max_grad_norm)),
    ("sample_rate", lambda e: float(e.sample_rate)),
    ("batch_size", lambda e: int(e.batch_size)),
    ("sample_size", lambda e: int(e.sample_size)),
    ("target_epsilon", lambda e: _optional_float(e.target_epsilon)),
    ("target_delta", lambda e: float(e.target_delta)),
    ("steps", lambda e: None if e.steps is None else int(e.steps)),
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
    tensors and plain Python values (``torch.save`` it; ``torch.load(weights_only=True)`` reads it).

    Public values only (module docstring): ``privacy`` (the privacy parameters, checked on load),
    ``accountant`` (name and ``history`` of ``(σ, q, steps)``), ``ledger`` (None, or the step
    ledger's ``run`` identifier and ``path``), ``noise_generator`` (None, or the state of a
    generator the user gave, reproducible by design), ``loss_scaling`` (None, or the fixed-scale
    GradScaler's ``state_dict()``). Raises ``ValueError`` while an attached optimizer holds a
    logical batch in progress (``virtual_step``): its sums are not yet noised; call it right
    after ``optimizer.step()``.
    """
    _refuse_accumulation(engine)
    generator = engine.noise_generator
    given = generator is not None and engine.noise_generator_given
    state = {
        "format": ENGINE_FORMAT,
        "version": VERSION,
        "privacy": {key: read(engine) for key, read in _PARAMETERS},
        **engine.accounting.state_dict(),  # "accountant", "ledger"
        "noise_generator": generator.get_state() if given else None,
        "noise_generator_device": generator.device.type if given else None,
        "loss_scaling": engine.loss_scaling.state_dict(),
        "clipping_mode": str(engine.clipping_mode),
    }
    tag = engine.topology.state_tag()
    if tag is not None:  # FSDP2: each rank's own generator, loaded on the rank that wrote it
        state["shard"] = tag
    return state


def check_engine_state_dict(engine, state: Dict[str, Any], *, ledger: LedgerArg = None,
                            near: Optional[str] = None) -> Optional[Tuple[str, LedgerContents]]:
    """Raise ``ValueError`` if ``state`` (from :func:`engine_state_dict`) cannot be loaded into
    ``engine``, with nothing changed: another format; the older format (version 1) without
    ``ledger=False``, or holding an accumulation in progress; a privacy parameter or the
    accountant history missing (the budget could not be restored); privacy parameters that
    differ from the engine's (each difference named); a given generator's state for an engine
    that draws from another kind of generator; a step ledger that is missing (without
    ``ledger=False``), of another run, or that does not extend the state's history.

    ``ledger``: None, the ledger the state names (looked up at its path, then under its name in
    the directory ``near``); a path, that ledger; False, none (the caller asserts that no step
    was released after the state). Returns the ledger's path and contents, or None."""
    if not isinstance(state, dict) or state.get("format") != ENGINE_FORMAT:
        raise ValueError("not a private_engine engine state (engine.state_dict()).")
    version = state.get("version")
    if version not in (VERSION, _OLD_VERSION):
        raise ValueError(f"engine state version {version!r} is not supported "
                         f"(this private_engine reads versions {_OLD_VERSION} and {VERSION}).")
    if version == _OLD_VERSION:
        _check_old_state(state, ledger)
    saved: Any = state.get("privacy")  # read from a file: checked below
    missing = [key for key, _ in _PARAMETERS if not isinstance(saved, dict) or key not in saved]
    if missing or not isinstance(state.get("accountant"), dict) or (
            "history" not in state["accountant"]):
        raise ValueError(
            "the checkpoint does not record all the privacy parameters this private_engine "
            f"compares (missing: {missing or ['accountant history']}); it was written by an "
            "older or another engine. Without them its budget (target_epsilon, steps) and "
            "its accountant history cannot be restored, and loading it would start a fresh "
            "budget guard over steps already spent. Resume from a checkpoint of this version, "
            "or start a new run.")
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
            + "; ".join(diffs) + ". Its accountant history is only valid under its own; build "
            "the engine with the checkpoint's parameters" + hint + ".")
    if version == VERSION and state["noise_generator"] is not None and engine.draws_noise:
        generator = engine.noise_generator
        if generator is None or not engine.noise_generator_given:
            raise ValueError(
                "the checkpoint holds the state of a noise generator the user gave (a "
                "reproducible run) but this engine draws secret noise: build it with a "
                "noise_generator to continue that run's stream.")
        if state.get("noise_generator_device") != generator.device.type:
            raise ValueError(
                f"the checkpoint's noise generator is a {state.get('noise_generator_device')} "
                f"generator, the engine's a {generator.device.type} one: build the engine with "
                "its model on the same kind of device.")
    history = [(float(s), float(q), int(n)) for s, q, n in state["accountant"]["history"]]
    return find_ledger(state if version == VERSION else {}, history, ledger, near)


def load_engine_state_dict(engine, state: Dict[str, Any], *, ledger: LedgerArg = None,
                           near: Optional[str] = None) -> None:
    """Restore ``engine`` from ``state`` (:func:`engine_state_dict`), after
    :func:`check_engine_state_dict` (a ValueError leaves the engine unchanged; ``ledger`` and
    ``near`` as there).

    The accountant's history becomes the ledger's (the state's, extended by every step recorded
    after it: ε counts the steps a killed run released after its checkpoint), or the state's when
    there is no ledger; the engine then records its later steps in that ledger (on the rank that
    records, :func:`use_ledger`). A given generator's state is restored; the default generator is
    left as it is (fresh noise). The fixed loss scale is restored. The sampling-rate check,
    ``dropped_samples`` and the loss-scaling counters keep their values (not in the state)."""
    found = check_engine_state_dict(engine, state, ledger=ledger, near=near)
    if found is None:
        engine.accounting.load_state_dict(state)
    else:
        path, contents = found
        engine.accounting.use_ledger(StepLedger.open(path, writer=engine.topology.records))
        engine.accountant.history = list(engine.ledger.history)
    if state.get("version") == VERSION:
        if state["noise_generator"] is not None and engine.draws_noise:
            engine.noise_generator.set_state(state["noise_generator"].cpu())
        engine.loss_scaling.load_state_dict(state["loss_scaling"])


def use_ledger(engine, path) -> StepLedger:
    """Record every later step of ``engine`` in the step ledger at ``path``, written and
    ``fsync``-ed before the step's update is applied; returns it (also ``engine.ledger``).

    A new file is created with the engine's history so far. An existing ledger is continued: its
    history must begin with the engine's, and the engine's accountant takes the ledger's history
    (the steps a run killed before its checkpoint released count; a fresh engine thus starts with
    what was spent in that ledger). Call it before the first step for a run killed before its
    first checkpoint to be counted by a restart that calls it again. :func:`save_checkpoint`
    calls it for an engine without a ledger (``<checkpoint>.ledger``).

    Data-parallel (also FSDP2): every rank calls it; rank 0 writes the file, then all ranks meet
    at a barrier and the others read it (it must be on a file system they share)."""
    path = os.path.abspath(os.fspath(path))
    current = engine.ledger
    if current is not None and current.path == path:
        return current
    records = engine.topology.records
    if records:
        if os.path.exists(path):
            ledger = StepLedger.open(path)
        else:
            ledger = StepLedger.create(path, engine.accountant.history)
    engine.topology.barrier()  # rank 0's file exists
    if not records:
        ledger = StepLedger.open(path, writer=False)
    if not is_prefix(engine.accountant.history, ledger.history):
        ledger.close()
        raise ValueError(
            f"the step ledger {path!r} does not begin with this engine's history "
            f"({engine.steps_taken} steps): it records another run. Give another path, or "
            "resume that run from its checkpoint (load_checkpoint).")
    engine.accounting.use_ledger(ledger)
    engine.accountant.history = list(ledger.history)
    return ledger


def find_ledger(state: Dict[str, Any], history, ledger: LedgerArg,
                 near: Optional[str]) -> Optional[Tuple[str, LedgerContents]]:
    """The step ledger to load with a state whose ``"ledger"`` entry names one (or None) and whose
    accountant history is ``history``: its path and contents, or None (``ledger=False``, or a
    state written without one). ``ledger`` and ``near`` as in :func:`check_engine_state_dict`.
    Raises ``ValueError`` if it is missing, of another run, or does not extend ``history``."""
    if ledger is False:
        return None
    if ledger is True:
        raise TypeError("ledger= takes a path, None (the checkpoint's own) or False (none).")
    named = state.get("ledger")
    if ledger is not None:
        candidates = [os.path.abspath(os.fspath(ledger))]
    elif named is None:
        return None  # written by an engine without a ledger (engine.state_dict())
    else:
        candidates = [named["path"]]
        if near is not None:
            candidates.append(os.path.join(near, os.path.basename(named["path"])))
    path = next((c for c in candidates if os.path.isfile(c)), None)
    if path is None:
        raise ValueError(
            f"the step ledger of this checkpoint is missing (looked for {candidates}): the steps "
            "the run released after the checkpoint cannot be counted. Restore the file, or pass "
            "ledger=<its path>; only if no step was released after the checkpoint, "
            "ledger=False.")
    contents = read_ledger(path)
    if named is not None and contents.run != named["run"]:
        raise ValueError(f"the step ledger {path!r} records another run than this checkpoint's "
                         f"(run {contents.run}, checkpoint {named['run']}).")
    if not is_prefix(history, contents.history):
        raise ValueError(
            f"the step ledger {path!r} records {contents.steps} steps, which do not extend the "
            f"checkpoint's {sum(n for _, _, n in history)}: it is not this checkpoint's ledger "
            "(or it was cut short).")
    return path, contents


def _check_old_state(state: Dict[str, Any], ledger: LedgerArg) -> None:
    """A version-1 state loads its accountant history only with ``ledger=False``, and only if
    it holds no accumulation in progress."""
    if any(acc is not None for acc in state.get("accumulation", [])):
        raise ValueError(
            "this checkpoint was written by an older private_engine (format version 1) in the "
            "middle of a logical batch: it holds clipped sums not yet noised, which this version "
            "neither writes nor loads. Resume from a checkpoint taken right after "
            "optimizer.step().")
    if ledger is not False:
        raise ValueError(
            "this checkpoint was written by an older private_engine (format version 1), which "
            "kept no step ledger: the steps the run released after it cannot be counted. Pass "
            "ledger=False to load it with its accountant history as the whole spend (only if no "
            "step was released after it). Its noise generator state is not restored (the "
            "resumed noise is fresh).")


def _refuse_accumulation(engine) -> None:
    """Refuse to save in the middle of a logical batch: its sums are clipped but not noised."""
    if any(s.accumulating for s in engine.attached_steps):
        raise ValueError(
            "a checkpoint cannot be taken while a logical batch is being accumulated "
            "(virtual_step): its clipped sums are not yet noised, and a checkpoint holds released "
            "values only. Checkpoint right after optimizer.step().")


# -- files -----------------------------------------------------------------------------------------
def save_checkpoint(path, *, model: nn.Module, optimizer: torch.optim.Optimizer, engine,
                    extra: Any = None) -> None:
    """Write ``model``'s and ``optimizer``'s ``state_dict()``, the engine's state
    (:func:`engine_state_dict`: privacy parameters, accountant history, ledger) and ``extra``
    (anything of yours: the epoch, a scheduler's state) to ``path``, atomically.

    Holds public values only (module docstring), so it may be published, ``extra`` aside (it is
    written as given). Raises ``ValueError`` in the middle of a logical batch (after a
    ``virtual_step``): checkpoint right after ``optimizer.step()``. An engine without a step
    ledger gets one first, ``<path>.ledger`` (refused if that file exists, being another run's;
    data-parallel: on rank 0, which records), in which every later step is recorded before its
    release (:func:`use_ledger`).

    ``optimizer`` must be attached to ``engine``. The file is written to a temporary file in the
    same directory (mode 0600), flushed and ``fsync``-ed, then renamed over ``path``
    (``os.replace``): a crash or an error mid-write leaves the previous checkpoint intact (a stale
    ``.<name>.*.tmp`` file may remain after a crash). ``extra`` should hold tensors and plain
    Python values, as :func:`load_checkpoint` reads with ``weights_only=True`` (register other
    types with ``torch.serialization.add_safe_globals``).

    Data-parallel (``engine.distributed``): every rank may call it; only rank 0 writes (the
    others check that they hold no accumulation in progress and return). Call
    ``torch.distributed.barrier()`` before other ranks read the file.
    """
    engine.topology.check_whole_states("save_checkpoint / load_checkpoint")  # FSDP2: refused
    _check_attached(engine, optimizer)
    _check_model(engine, model)
    _refuse_accumulation(engine)
    if not engine.topology.records:
        return  # rank 0 writes
    if engine.ledger is None:
        engine.accounting.use_ledger(StepLedger.beside(path, engine.accountant.history))
    checkpoint = {
        "format": CHECKPOINT_FORMAT,
        "version": VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "engine": engine_state_dict(engine),
        "extra": extra,
    }
    atomic_save(checkpoint, path)
    log.info("checkpoint written to %s after %d steps (ε=%.4g)", os.fspath(path),
             engine.steps_taken, engine.get_epsilon())


def load_checkpoint(path, *, model: nn.Module, optimizer: torch.optim.Optimizer, engine,
                    ledger: LedgerArg = None) -> Any:
    """Restore ``model``, ``optimizer`` and ``engine`` from a file of :func:`save_checkpoint` and
    return its ``extra``.

    Build the model, the optimizer and the engine as for the original run (same privacy
    parameters) and attach the optimizer first. The accountant takes the history of the
    checkpoint's step ledger, which counts every step the run may have released after the
    checkpoint too, and the engine goes on recording in that ledger. The ledger is looked up at
    the path the checkpoint names, then under its name next to ``path``; ``ledger=`` gives another
    path, or False to load without one (the caller asserts that no step was released after the
    checkpoint; also needed for a checkpoint of the older format, version 1). The noise of the
    resumed run is fresh (unless the user gave the generator, whose state is restored).

    The file is read with ``torch.load(weights_only=True, map_location="cpu")``. Anything
    refused (other privacy parameters, a missing or foreign ledger, an older checkpoint taken
    mid-batch) raises ``ValueError`` before anything changes. Data-parallel: every rank loads
    rank 0's file and reads the same ledger; rank 0 records in it.
    """
    engine.topology.check_whole_states("save_checkpoint / load_checkpoint")  # FSDP2: refused
    _check_attached(engine, optimizer)
    _check_model(engine, model)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a private_engine checkpoint "
                         "(private_engine.save_checkpoint).")
    if checkpoint.get("version") not in (VERSION, _OLD_VERSION):
        raise ValueError(f"checkpoint version {checkpoint.get('version')!r} is not supported "
                         f"(this private_engine reads versions {_OLD_VERSION} and {VERSION}).")
    near = os.path.dirname(os.path.abspath(os.fspath(path)))
    check_engine_state_dict(engine, checkpoint["engine"], ledger=ledger, near=near)  # first
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    load_engine_state_dict(engine, checkpoint["engine"], ledger=ledger, near=near)
    engine.state_guard.arm()  # the loaded parameters are where the next step starts
    log.info("checkpoint %s loaded: %d steps taken (ε=%.4g)", os.fspath(path),
             engine.steps_taken, engine.get_epsilon())
    return checkpoint["extra"]


def _check_attached(engine, optimizer) -> None:
    if not any(s.optimizer is optimizer for s in engine.attached_steps):
        raise ValueError("the optimizer is not attached to this engine (engine.attach(optimizer)): "
                         "a checkpoint is taken between its logical batches, through the engine.")


def _check_model(engine, model) -> None:
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for p in engine.params):
        raise ValueError("the model is not the engine's: its parameters do not include the "
                         "parameters the engine clips.")


class EngineStateful:
    """An engine's state as a ``torch.distributed.checkpoint`` ``Stateful``: pass
    ``{"engine": EngineStateful(engine), ...}`` to ``dcp.save`` / ``dcp.load`` on every rank, next
    to the model's and optimizer's sharded state dicts (``get_model_state_dict``,
    ``get_optimizer_state_dict``).

    Each rank's :meth:`engine.state_dict() <private_engine.PrivacyEngine.state_dict>` is stored
    under a key of its own, ``rank{r}`` (``torch.save`` bytes: tensors and plain values only,
    read back with ``weights_only=True``): ``torch.distributed.checkpoint`` keeps one copy of an
    item that every rank holds under one key, while FSDP2 ranks hold different states (each
    rank's own generator draws the noise of its own rows), which load only on the rank that
    wrote them. Loading needs the same world size (a missing ``rank{r}`` key fails the load)."""

    def __init__(self, engine):
        self.engine = engine

    def _key(self) -> str:
        return f"rank{self.engine.topology.rank}"

    def state_dict(self) -> Dict[str, Any]:
        """``{"rank{r}": bytes of engine.state_dict()}``."""
        buffer = io.BytesIO()
        torch.save(self.engine.state_dict(), buffer)
        return {self._key(): buffer.getvalue()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """``engine.load_state_dict`` of this rank's state (its checks apply: the privacy
        parameters, the ledger, the rank)."""
        if self._key() not in state:
            raise ValueError(f"the checkpoint holds no engine state for {self._key()} (it has "
                             f"{sorted(state)}): load it with the world size that saved it.")
        blob = state[self._key()]
        self.engine.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))


__all__ = ["engine_state_dict", "check_engine_state_dict", "load_engine_state_dict",
           "save_checkpoint", "load_checkpoint", "use_ledger", "find_ledger", "atomic_save",
           "LEDGER_SUFFIX", "EngineStateful"]
