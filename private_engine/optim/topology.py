"""Where a private step runs, chosen once when the engine is built: one process, replicas over the
ranks of a process group (data parallel), or shards of an FSDP2 model. The three are small classes
with one interface (:class:`Topology`), so that the engine and the private step never ask which
one they run on.

What differs between them is where the clipped sums meet and who draws which noise. With
``s_r = Σ_{i ∈ S_r} C_i g_i`` the clipped sums of rank r's samples, σ the noise multiplier, R the
clipping threshold and B the expected logical batch size, every topology releases

    ĝ = (Σ_r s_r + σR·ξ) / B,    ξ ~ N(0, I) over every coordinate, drawn once

(Abadi et al. 2016, "Deep Learning with Differential Privacy"):

* :class:`SingleProcess`: one rank, ``ĝ = (s_0 + σR·ξ) / B`` computed locally;
* :class:`Replicated`: rank 0 adds ``σR·ξ`` to its local sums, one ``all_reduce(SUM)`` per flat
  buffer gives every rank the same noisy total (:mod:`.distributed`);
* :class:`Sharded`: the clipped sums are reduce-scattered into the FSDP2 shards and each rank adds
  the noise of the rows it owns (:mod:`.sharded`): the shards partition the coordinates, so each
  coordinate's noise is drawn once.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..clipping.batch import ClippedBatch, check_batch
from ..clipping.grad_sums import GradSums
from ..foundation.dtypes import cast
from ..process_group import wants_distributed
from .distributed import DataParallel, StepCounts
from .noise import NoiseSpec, add_gaussian_noise
from .sharded import ShardedDataParallel, fsdp1_names, fsdp2_modules


def add_noise(sums: GradSums, std: float, noise: NoiseSpec) -> None:
    """``sums ← sums + std·ξ``, ξ ~ N(0, I) over every coordinate of every buffer (each
    coordinate once: the buffers cover the parameters' sums exactly once); nothing when
    ``std = 0``."""
    if std > 0:
        add_gaussian_noise(sums.buffers, std, noise.generator, noise.secure_mode)


def scaled_grads(sums: GradSums, params: Sequence[torch.Tensor],
                 expected_batch_size: int) -> List[torch.Tensor]:
    """``sums / B`` per parameter, each a tensor of its own in the parameter's dtype (one
    multi-tensor division out of the flat buffers)."""
    grads = sums.own_grads(float(expected_batch_size))
    return [cast(g, p.dtype) for p, g in zip(params, grads)]


class Topology:
    """The interface of the three topologies; this base is the one-process behaviour.

    Attributes:
        collectives: the collectives of the process group (:class:`.distributed.DataParallel`,
            :class:`.sharded.ShardedDataParallel`), None for one process.
        sharded: whether the parameters the optimizer updates are FSDP2 shards.
    """

    collectives: Optional[DataParallel] = None
    sharded = False

    # -- who this process is ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the default process group (0 for one process)."""
        return 0 if self.collectives is None else self.collectives.rank

    @property
    def world_size(self) -> int:
        """W, the number of ranks (1 for one process)."""
        return 1 if self.collectives is None else self.collectives.world_size

    @property
    def distributed(self) -> bool:
        """Whether the steps run over a process group (replicas or shards)."""
        return self.collectives is not None

    @property
    def adds_noise(self) -> bool:
        """Whether this process draws noise (one process; rank 0 of replicas; every shard)."""
        return True

    @property
    def records(self) -> bool:
        """Whether this process writes the step ledger and checkpoint files (rank 0)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank waits for the others (nothing for one process)."""

    # -- construction ----------------------------------------------------------------------------
    def unsharded(self) -> ContextManager[None]:
        """Inside, every module holds the parameters it computes with (FSDP2: gathered)."""
        return contextlib.nullcontext()

    def clip_params(self, params: Sequence[nn.Parameter]) -> List[nn.Parameter]:
        """The tensors the clipping core keys on for the optimizer's ``params``."""
        return list(params)

    def check_scan(self, scan) -> None:
        """Refuse what this topology cannot clip in ``scan`` (:func:`scan_model`'s result)."""

    def prepare_model(self, model: nn.Module) -> None:
        """Make the ranks' models start from the same state (nothing for one process)."""

    def check_generator(self, generator: Optional[torch.Generator]) -> None:
        """Refuse noise generators whose draws would repeat across the ranks that draw."""

    def bind(self, clipper) -> None:
        """Configure the clipper built for this topology."""

    def attach(self) -> None:
        """On ``engine.attach``: take over what the engine does instead of the wrapper."""

    def detach(self) -> None:
        """On ``engine.detach``: give the wrapper its own settings back."""

    def parameter_names(self, names: Dict[int, str],
                        params: Sequence[nn.Parameter]) -> Dict[int, str]:
        """``names`` (``{id(parameter): name}``) with the clipped tensors' ids added."""
        return names

    # -- a physical batch ------------------------------------------------------------------------
    def check_ready(self) -> None:
        """Before a physical batch is clipped: the wrapper is still in the engine's hands."""

    def clip(self, loss: torch.Tensor, *, clipper, clip: Callable[..., ClippedBatch],
             check: Callable[[], None], names: Dict[int, str],
             params: Sequence[nn.Parameter]) -> ClippedBatch:
        """One physical batch of per-sample ``loss`` through ``clip`` (the engine's clipping
        core call), then ``check`` (the state guard), before any of it is released."""
        batch = clip(loss)
        check()
        return batch

    # -- the release -----------------------------------------------------------------------------
    def clip_failed(self) -> None:
        """This rank's clipping of the step raised: the other ranks must not wait for it."""

    def exchange(self, samples: int, sums: GradSums,
                 params: Sequence[nn.Parameter]) -> StepCounts:
        """The logical batch's sample count over the ranks, and whether the ranks' sums sit in
        the same layout (one process: its own)."""
        return StepCounts(samples=samples, same_layout=True, failed=[])

    def release(self, sums: GradSums, params: Sequence[nn.Parameter], std: float,
                noise: NoiseSpec, same_layout: bool = True) -> List[torch.Tensor]:
        """``(Σ_r s_r + std·ξ) / B`` per parameter of ``params`` from this rank's sums ``s_r``
        (``std = σR``; ``B = noise.expected_batch_size``); one process: ``(s_0 + std·ξ) / B``."""
        add_noise(sums, std, noise)
        return scaled_grads(sums, params, noise.expected_batch_size)

    def after_step(self, params: Sequence[nn.Parameter]) -> None:
        """After a step that succeeded and was accounted (the replica check)."""

    # -- checkpoints -----------------------------------------------------------------------------
    def check_whole_states(self, what: str) -> None:
        """Refuse ``what`` (a one-file checkpoint) where the model's and optimizer's states are
        not whole on each rank (FSDP2 shards)."""

    def state_tag(self) -> Optional[dict]:
        """What an engine state must carry to be loaded here (FSDP2: the rank that wrote it)."""
        return None

    def check_state_tag(self, state) -> None:
        """Refuse an engine state written by another rank where the ranks' states differ."""


class SingleProcess(Topology):
    """One process: clips, noises and steps on its own (the :class:`Topology` behaviour)."""


class Replicated(Topology):
    """Data-parallel replicas over the default process group (:mod:`.distributed`): each rank
    clips its own samples; rank 0 alone adds the noise before the sums are all-reduced.

    Args:
        device: the device of the collectives' small tensors.
        check_replicas: after every step compare a float64 checksum of the ranks' parameters
            (:meth:`.distributed.DataParallel.check_replicas`).
    """

    collectives: DataParallel

    def __init__(self, device: torch.device, check_replicas: bool = False):
        self.collectives = DataParallel(device)
        self.check_replicas = bool(check_replicas)

    @property
    def adds_noise(self) -> bool:
        """True on rank 0, the only rank that draws the noise σR·ξ."""
        return self.collectives.adds_noise

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def prepare_model(self, model: nn.Module) -> None:
        """Every parameter and buffer from rank 0 (as ``DistributedDataParallel`` does)."""
        self.collectives.broadcast_module(model)

    def clip_failed(self) -> None:
        self.collectives.exchange(0, 0, failed=True)  # the other ranks raise instead of waiting

    def exchange(self, samples: int, sums: GradSums,
                 params: Sequence[nn.Parameter]) -> StepCounts:
        """One ``all_gather`` of every rank's count, layout code and error flag
        (:meth:`.distributed.DataParallel.exchange`)."""
        c = self.collectives
        return c.exchange(samples, c.layout_code(sums, params))

    def release(self, sums: GradSums, params: Sequence[nn.Parameter], std: float,
                noise: NoiseSpec, same_layout: bool = True) -> List[torch.Tensor]:
        """Rank 0 adds ``σR·ξ`` to its local sums, then every buffer is all-reduced, so every
        rank divides ``Σ_r s_r + σR·ξ`` by B — one Gaussian draw in total, before any sum leaves
        a rank. The buffers are ``sums``' own when every rank holds the same flat layout
        (``same_layout``), else a canonical copy
        (:meth:`.distributed.DataParallel.reduction_sums`), so the collectives match."""
        c = self.collectives
        target = c.reduction_sums(sums, params, same_layout)
        if c.adds_noise:
            add_noise(target, std, noise)
        c.all_reduce_(target.buffers)
        return scaled_grads(target, params, noise.expected_batch_size)

    def after_step(self, params: Sequence[nn.Parameter]) -> None:
        """``check_replicas``: the ranks' parameters must be equal bit for bit."""
        if self.check_replicas:
            self.collectives.check_replicas(params)


class Sharded(Topology):
    """An FSDP2 (``fully_shard``) model over the default process group (:mod:`.sharded`): the
    clipping core keys on FSDP2's unsharded parameters, the clipped sums are reduce-scattered
    into the shards and each rank noises its own rows.

    Args:
        model: the FSDP2 model.
        device: the device of the collectives' small tensors.
    """

    sharded = True

    def __init__(self, model: nn.Module, device: torch.device):
        self.collectives: ShardedDataParallel = ShardedDataParallel(model, device)
        #: whether physical batches are clipped with FSDP2's per-unit all-gathers (:meth:`bind`)
        self.streamed = False

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def unsharded(self) -> ContextManager[None]:
        return self.collectives.unsharded()

    def clip_params(self, params: Sequence[nn.Parameter]) -> List[nn.Parameter]:
        """FSDP2's unsharded parameter of each shard: what the modules hold while computing."""
        return self.collectives.unsharded_params(params)

    def check_scan(self, scan) -> None:
        if scan.fallbacks:
            raise ValueError(
                "PrivacyEngine on an FSDP2 (fully_shard) model: the torch.func fallback is "
                f"not supported ({[n for n, _ in scan.fallbacks]}): it replays modules "
                "functionally on parameters that FSDP2 swaps between shards and gathered "
                "tensors. Register a layer rule for these modules, or train them unsharded "
                "(docs/distributed.md, \"FSDP2\").")

    def prepare_model(self, model: nn.Module) -> None:
        """Every buffer from rank 0 (the parameters are shards, each rank's own)."""
        self.collectives.broadcast_module(model)

    def check_generator(self, generator: Optional[torch.Generator]) -> None:
        self.collectives.check_generators(generator)

    def bind(self, clipper) -> None:
        """One flat buffer of clipped sums per FSDP2 unit (freed once reduce-scattered), and
        whether the batches can stream unit by unit (:meth:`ShardedDataParallel.can_stream`)."""
        clipper.buffer_group = self.collectives.unit_of
        self.streamed = self.collectives.can_stream(clipper)

    def attach(self) -> None:
        self.collectives.take_over_fsdp()

    def detach(self) -> None:
        self.collectives.restore_fsdp()  # FSDP2 reduces its own gradients again

    def parameter_names(self, names: Dict[int, str],
                        params: Sequence[nn.Parameter]) -> Dict[int, str]:
        """The names of the ``DTensor`` shards given to the unsharded parameters too."""
        for p in params:
            if id(p) in names:
                u = self.collectives.unsharded_params([p])[0]
                names[id(u)] = names[id(p)]
        return names

    def check_ready(self) -> None:
        self.collectives.check_fsdp_state()

    def clip(self, loss: torch.Tensor, *, clipper, clip: Callable[..., ClippedBatch],
             check: Callable[[], None], names: Dict[int, str],
             params: Sequence[nn.Parameter]) -> ClippedBatch:
        """This rank's clipped sums of one physical batch, reduce-scattered into its shard sums
        (:mod:`.sharded`). The ranks first agree (one small all-gather) on how every rank runs
        the batch: with FSDP2's per-unit all-gathers in the one backward of a book-keeping mode
        (each unit's sums formed and reduce-scattered in turn after the clip factors; a rank
        with an empty batch runs the same backward on its zero-row graph), or, for the two-pass
        modes, rules that read weights, and batches on which some rank runs the separability
        probe, with the whole model gathered; a rank whose checks failed makes every rank raise
        before the backward."""
        d = self.collectives
        error, walk = None, None
        try:
            walk = check_batch(clipper, loss, names)
        except Exception as e:
            error = e
        probe = clipper.probe is not None and clipper.probe.pending
        graphless = error is None and loss.numel() == 0 and loss.grad_fn is None  # no backward
        gather, failed = d.agree(error is None and (probe and loss.numel() > 0 or graphless),
                                 error is not None)
        if error is not None:
            raise error
        if failed:
            clipper.release()
            raise RuntimeError(f"rank(s) {failed} could not clip their batch (see their error): "
                               "this step is refused on every rank; nothing was updated.")
        try:
            if self.streamed and not gather:
                sums = d.new_shard_sums(params)
                with d.streaming():
                    if loss.numel() == 0:
                        d.empty_backward(clipper, loss)
                        batch = ClippedBatch(sums, 0, None, 0)
                    else:
                        batch = clip(loss, walk=walk, sums_by_buffer=d.sums_sink(sums))
                        batch.sums = sums
                d.fill_missing(sums)
            else:
                with d.unsharded():  # one all-gather of every unit, the same on every rank
                    batch = clip(loss, walk=walk, before_sums=d.free_gathered)
                batch.sums = d.scatter(batch.sums, params)
            check()
        finally:
            d.end_batch()
        return batch

    def clip_failed(self) -> None:
        self.collectives.exchange(0, 0, failed=True)

    def exchange(self, samples: int, sums: GradSums,
                 params: Sequence[nn.Parameter]) -> StepCounts:
        c = self.collectives
        return c.exchange(samples, c.layout_code(sums, params))

    def release(self, sums: GradSums, params: Sequence[nn.Parameter], std: float,
                noise: NoiseSpec, same_layout: bool = True) -> List[torch.Tensor]:
        """Each rank's rows of ``(Σ_r s_r + σR·ξ) / B`` as ``DTensor`` gradients, the noise of
        its own rows drawn by it (:meth:`ShardedDataParallel.release`)."""
        return self.collectives.release(sums, params, std, noise.expected_batch_size,
                                        noise.generator, noise.secure_mode)

    def check_whole_states(self, what: str) -> None:
        """The model and optimizer states are ``DTensor`` shards, one part per rank, so one file
        written by rank 0 would hold a fraction of the model."""
        raise ValueError(
            f"{what} do not handle FSDP2 (fully_shard) models: the "
            "model and optimizer states are shards, one part per rank. Save model and optimizer "
            "with torch.distributed.checkpoint (get_model_state_dict / "
            "get_optimizer_state_dict) and the engine as "
            "private_engine.checkpoint.EngineStateful(engine) in the same dcp.save / dcp.load, "
            "after private_engine.checkpoint.use_ledger(engine, path) on every rank "
            "(docs/distributed.md, \"FSDP2\").")

    def state_tag(self) -> Optional[dict]:
        """Each rank's own generator: a state is loaded on the rank that wrote it."""
        return {"rank": self.rank, "world_size": self.world_size}

    def check_state_tag(self, state) -> None:
        mine = {"rank": self.rank, "world_size": self.world_size}
        if not isinstance(state, dict) or state.get("shard") != mine:
            raise ValueError(
                f"this FSDP2 engine (rank {mine['rank']} of {mine['world_size']}) loads only "
                f"the state its own rank wrote (engine.state_dict() on rank {mine['rank']}); "
                f"this one is {state.get('shard') if isinstance(state, dict) else None}: "
                "each rank draws the noise of its own rows from its own generator, and "
                "two ranks restoring one state would repeat their noise.")


def check_model_wrappers(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``), after refusing the wrappers the
    engine cannot train through: ``DistributedDataParallel`` (or Opacus' DPDDP) — the engine forms
    no ``.grad`` by autograd (it clips per sample in its own backward), so the wrapper's gradient
    all-reduce would never carry the clipped sums; the engine reduces those itself — and FSDP1
    (``FullyShardedDataParallel``), whose flat parameters hide the layers' own weights."""
    wrapped = isinstance(model, nn.parallel.DistributedDataParallel) or (
        type(model).__name__ == "DifferentiallyPrivateDistributedDataParallel")
    if wrapped:
        raise ValueError(
            f"PrivacyEngine got a {type(model).__name__}: pass the bare module "
            "(ddp_model.module). The engine clips each sample's gradient in its own backward, "
            "which forms no .grad for DDP's reducer to all-reduce, and sums the ranks' clipped "
            "gradients itself (noise once, on rank 0) under an initialised process group "
            "(distributed=None detects it).")
    names = fsdp1_names(model)
    if names:
        raise ValueError(
            f"PrivacyEngine got a model wrapped by FSDP1 ({names[:3]}): its flat parameters hide "
            "the layers' own weights, which per-sample clipping needs. Shard it with FSDP2 "
            "instead (torch.distributed.fsdp.fully_shard), which the engine supports "
            "(docs/distributed.md, \"FSDP2\").")
    return bool(fsdp2_modules(model))


def choose_topology(model: nn.Module, distributed: Optional[bool], check_replicas: bool,
                    device: torch.device, sharded: bool) -> Topology:
    """The topology of an engine on ``model``: :class:`Sharded` for an FSDP2 model (``sharded``;
    ``distributed`` must not be False and ``check_replicas`` must be off), :class:`Replicated`
    when :func:`private_engine.process_group.wants_distributed` says so, else
    :class:`SingleProcess`."""
    if sharded:
        if distributed is False:
            raise ValueError(
                "PrivacyEngine got an FSDP2 (fully_shard) model with distributed=False: its "
                "parameters are shards of one model held by all the ranks; leave "
                "distributed=None.")
        if check_replicas:
            raise ValueError(
                "check_replicas=True compares replicas; under FSDP2 the ranks hold different "
                "shards of the parameters, not replicas.")
        return Sharded(model, device)
    if wants_distributed(distributed):
        return Replicated(device, check_replicas)
    return SingleProcess()


__all__ = ["Replicated", "Sharded", "SingleProcess", "Topology", "add_noise",
           "check_model_wrappers", "choose_topology", "scaled_grads"]
