"""Private steps on an FSDP2-sharded model (``torch.distributed.fsdp.fully_shard``): each rank clips
its own samples on the unsharded parameters, each unit's clipped sums are reduce-scattered into
the parameters' dim-0 shards, and each shard's owner adds the noise of the coordinates it owns.

FSDP2 keeps each parameter as a ``DTensor`` shard, ``Shard(0)``: with W ranks and a parameter of
``d₀`` rows, rank r owns rows ``[r·c, min((r+1)·c, d₀))``, ``c = ⌈d₀/W⌉`` (the last shards padded
or empty). For a module's forward and backward it all-gathers the rows into one unsharded
``nn.Parameter`` per parameter — an object FSDP2 creates once and keeps, refilling its storage at
every all-gather — and assigns it to the module. Everything the clipping core knows about a
parameter (layer rules, tracer, graph walk, flat buffers) is keyed by the tensor the module holds
while it computes, so the engine builds its clipper on these unsharded objects and keeps the
``DTensor`` shards for the optimizer. A logical batch, on rank r with its samples S_r:

1. for each physical batch the ranks first agree (:meth:`ShardedDataParallel.agree`, one small
   all-gather) on how every rank runs it, since every rank must issue the same collectives:

   * **per unit** (book-keeping modes whose layer rules read only shapes,
     :meth:`ShardedDataParallel.can_stream`): the engine's one backward (the norm pass) runs
     under FSDP2's own schedule (:meth:`ShardedDataParallel.streaming`): each unit all-gathered
     by FSDP2's pre-backward hook and resharded after its backward; a rank with an empty batch
     runs the same backward on its zero-row graph (:meth:`ShardedDataParallel.empty_backward`).
     After the clip factors C, the clipped sums ``gᵀ·diag(C)·a`` — which need the kept
     activations and output gradients, not the weights — are formed one unit at a time, each
     unit's full-size sums reduce-scattered at once into this rank's rows and freed
     (:meth:`PerSampleClipper.clipped_sums_by_buffer`, :meth:`ShardedDataParallel.sums_sink`);
   * **whole model** (two-pass modes, rules that read weights, and any batch on which some rank
     runs the separability probe, whose extra backward passes the other ranks do not run, or
     an empty batch without a graph): every unit all-gathered once
     (:meth:`ShardedDataParallel.unsharded`), the rank's samples clipped with no communication
     in the backward passes, the full-size sums (one flat buffer per unit) reduce-scattered
     unit by unit (:meth:`ShardedDataParallel.scatter`).

   Either way the physical batch gives this rank's *shard sums*: its rows of
   ``Σ_q s_q``, ``s_q = Σ_{i ∈ S_q} C_i g_i`` (the sum is linear, so summing the ranks' sums and
   cutting them into shards commute), one slot per unit and dtype, accumulated over the
   physical batches of a logical batch. FSDP2's gradient reduction is switched off
   (``set_requires_gradient_sync(False)``), and the norm pass forms no ``.grad``: it asks
   autograd for activation gradients only;
2. at the step rank r adds ``σR·ξ_r`` to its own rows only, ξ_r ~ N(0, I) from its own
   generator, divides by the global expected batch size B and sets its shard of
   ``(s + σR·ξ)/B`` as the ``DTensor`` ``.grad`` of each parameter; the wrapped optimizer steps
   on the shards, as under FSDP2 alone.

Why this is as private as one process (Abadi et al. 2016, "Deep Learning with Differential
Privacy"): the shards partition the coordinates, so every coordinate's noise is drawn by exactly
one rank, once; the ranks' generators are independent (entropy-seeded on each rank; generators
given by the user are checked to differ), so the noise of the whole released vector is
``(ξ_0, …, ξ_{W−1})·σR ~ N(0, σ²R²I)`` — the Gaussian mechanism at noise multiplier σ on
``F(D) = Σ_q s_q``, whose sensitivity is R (one sample sits on one rank and moves its ``s_q`` by at
most R; cutting a vector into shards does not change its norm). No coordinate gets noise twice
(which would be √2 too much) or not at all. As in data-parallel training, the ranks are trusted
with the data they hold: rank r sees the sum of the ranks' clipped sums on its rows before it
noises them, as rank 0 of the data-parallel path knows the noise it adds; the guarantee is about
what is released, the updated parameters.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Dict, Iterator, List, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from ..clipping.grad_sums import GradSums
from ..foundation.dtypes import accumulation_dtype
from ..process_group import process_group_ready
from .distributed import DataParallel
from .noise import add_gaussian_noise


def fsdp2_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` was applied to, in ``modules()``
    order (the same order on every rank)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp1_names(model: nn.Module) -> List[str]:
    """Names of FSDP1 flat parameters / wrapped modules in ``model`` (empty when none)."""
    names = [n for n, _ in model.named_parameters()
             if n.endswith("_flat_param") or "_fsdp_wrapped_module" in n]
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        names.append("FullyShardedDataParallel")
    return names


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(f"PrivacyEngine on an FSDP2 (fully_shard) model: {what} is not supported: "
                      f"{why} (docs/distributed.md, \"FSDP2\").")


def rules_without_weights() -> frozenset:
    """The layer rules whose clipped sums (``weighted_grads``, from kept ``(a, g)``) read only
    their module's shapes and hyper-parameters, never its parameters' values."""
    from ..layers.conv import ConvRule
    from ..layers.embedding import EmbeddingRule
    from ..layers.linear import LinearRule, TransposedLinearRule
    from ..layers.normalization import (
        GroupNormRule,
        HFRMSNormRule,
        InstanceNormRule,
        LayerNormRule,
        RMSNormRule,
    )

    return frozenset((LinearRule, TransposedLinearRule, ConvRule, EmbeddingRule, LayerNormRule,
                      GroupNormRule, RMSNormRule, HFRMSNormRule, InstanceNormRule))


def _sums_need_no_weights(clipper, rules) -> bool:
    """Whether the clipped sums of ``clipper``'s batch, once the clip factors are known, read no
    parameter's values: a book-keeping mode (no second backward) and only ``rules`` of
    :func:`rules_without_weights`."""
    return not clipper.strategy.retain_graph and all(
        type(rule) in rules_without_weights() for rule in rules)


class ShardedDataParallel(DataParallel):
    """The collectives of private training on an FSDP2-sharded model over the default process
    group (module docstring).

    Args:
        model: the model, ``fully_shard`` applied to its root (and to any submodules); every
            trainable parameter must be managed by FSDP2, sharded ``Shard(0)`` over one 1-D mesh
            of all the ranks, without a mixed-precision policy or CPU offloading.
        device: the device of the small tensors of the collectives.

    Refuses (``ValueError``, naming what and why) what the engine cannot clip exactly: trainable
    parameters outside FSDP2, other placements or meshes (HSDP, tensor parallelism), FSDP2's
    mixed precision (parameters computed in another dtype than the shards the optimizer updates)
    and CPU offloading, parameters shared between modules of different FSDP2 units (shared
    within one unit they are clipped together, as on an unsharded model).
    """

    def __init__(self, model: nn.Module, device: torch.device = torch.device("cpu")):
        if not process_group_ready():
            raise ValueError("an FSDP2 (fully_shard) model needs an initialised default process "
                             "group (torch.distributed.init_process_group).")
        super().__init__(device)
        self.modules = fsdp2_modules(model)
        groups = [g for m in self.modules for g in m._get_fsdp_state()._fsdp_param_groups]
        #: id(sharded DTensor parameter) -> FSDP2's FSDPParam
        self._fsdp: Dict[int, object] = {id(fp.sharded_param): fp
                                          for g in groups for fp in g.fsdp_params}
        names = {id(p): n for n, p in model.named_parameters()}
        outside = [n for n, p in model.named_parameters()
                   if p.requires_grad and id(p) not in self._fsdp]
        if outside:
            raise _refuse("trainable parameters outside fully_shard", f"{outside[:5]} are not "
                          "managed by FSDP2 (apply fully_shard to the root module too)")
        for fp in self._fsdp.values():
            self._check_param(fp, names.get(id(fp.sharded_param), repr(fp)))
        self._check_tied_in_one_unit(model)
        self._groups = groups
        #: id(FSDPParam) -> index of its FSDP2 unit (parameter group), the same on every rank
        self._unit: Dict[int, int] = {id(fp): i for i, g in enumerate(groups)
                                      for fp in g.fsdp_params}
        #: FSDP2's own settings, restored by :meth:`restore_fsdp` (engine.detach())
        self._fsdp_settings = [(g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward)
                               for g in groups]
        self.take_over_fsdp()
        with self.unsharded():  # FSDP2 creates its unsharded parameters at the first all-gather
            self._unsharded = {k: fp._unsharded_param for k, fp in self._fsdp.items()}
        self._unit_of_unsharded = {id(self._unsharded[k]): self._unit[id(fp)]
                                   for k, fp in self._fsdp.items()}

    def _check_param(self, fp, name: str) -> None:
        from torch.distributed.tensor import Shard

        mesh = fp.sharded_param.device_mesh
        if mesh.ndim != 1 or mesh.size() != self.world_size:
            raise _refuse(f"the mesh of {name}", f"{mesh.ndim}-D of size {mesh.size()}; the "
                          f"engine supports a 1-D mesh of all {self.world_size} ranks (HSDP and "
                          "tensor parallelism are not supported)")
        if getattr(fp, "is_dtensor", False) or fp.fsdp_placement != Shard(0):
            raise _refuse(f"the placement of {name}", f"{fp.fsdp_placement}; only FSDP2's "
                          "default Shard(0) of plain parameters is supported")
        policy = fp.mp_policy
        dtypes = (policy.param_dtype, policy.reduce_dtype)
        if any(d is not None and d != fp.sharded_param.dtype for d in dtypes):
            raise _refuse("MixedPrecisionPolicy", "the per-sample norms would be computed on "
                          "parameters of another dtype than the shards that are released; use "
                          "torch.autocast (bfloat16) for mixed precision instead")
        if getattr(fp, "offload_to_cpu", False):
            raise _refuse("CPUOffloadPolicy", "the shards live on the CPU while the clipped sums "
                          "are reduced on the device")

    def _check_tied_in_one_unit(self, model: nn.Module) -> None:
        """Refuse a parameter held by a module that FSDP2 does not assign it to (weights tied
        after ``fully_shard``): FSDP2 puts a parameter's unsharded tensor into its module and
        the modules sharing it when the unit was built, and any other module holding it would
        compute on the ``DTensor`` shard. A weight tied before ``fully_shard`` with every use
        under one unit (an embedding and its language-model head under the root) is one
        unsharded tensor in all its modules and is clipped as on an unsharded model (the
        per-sample gradients of its uses summed, then normed). ``fully_shard`` on a submodule
        holding only one use unties the weight (each unit gets a parameter of its own): the
        engine then clips two parameters, as the model now has."""
        fp_names = {}
        for fp in self._fsdp.values():
            info = fp._module_info
            fp_names[id(fp)] = {(id(info.module), info.param_name)} | {
                (id(m), n) for m, n in zip(info.shared_modules, info.shared_param_names)}
        names = {id(p): n for n, p in model.named_parameters()}
        for mname, mod in model.named_modules():
            for pname, p in mod._parameters.items():
                fp = self._fsdp.get(id(p))
                if fp is not None and (id(mod), pname) not in fp_names[id(fp)]:
                    held = f"{mname}.{pname}" if mname else pname
                    raise _refuse(
                        f"the shared (tied) parameter {names.get(id(p), held)}",
                        f"{held} holds it too, but FSDP2 does not give that module the "
                        "unsharded tensor (the weights were tied after fully_shard), so that use "
                        "would compute on the DTensor shard. Tie the weights before fully_shard, "
                        "with every use under one fully_shard unit (e.g. the root for an "
                        "embedding tied with the output head)")

    def take_over_fsdp(self) -> None:
        """Switch FSDP2's gradient reduction off (no raw gradient is ever reduce-scattered: the
        engine reduces the clipped sums) and its reshard after backward (the engine reshards once
        its clipping is done, :meth:`unsharded`)."""
        for g in self._groups:
            g.reduce_grads = g.all_reduce_grads = False
            g.reshard_after_backward = False

    def drop_raw_grads(self) -> None:
        """Drop any raw (unclipped) gradient on FSDP2's unsharded parameters and its
        accumulation buffer: released nowhere, and never reduce-scattered later."""
        for fp in self._fsdp.values():
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                unsharded.grad = None
            if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                fp.unsharded_accumulated_grad = None

    def restore_fsdp(self) -> None:
        """Give FSDP2 its own settings back (the engine is detached: training without it); raw
        gradients left on the unsharded parameters are dropped first."""
        self.drop_raw_grads()
        for g, (reduce, all_reduce, reshard) in zip(self._groups, self._fsdp_settings):
            g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward = reduce, all_reduce, \
                reshard

    # -- noise -----------------------------------------------------------------------------------
    @property
    def adds_noise(self) -> bool:
        """True on every rank: each adds the noise of the rows it owns."""
        return True

    def check_generators(self, generator: Optional[torch.Generator]) -> None:
        """Refuse (on every rank) noise generators whose states are equal on two ranks: their
        draws would repeat across shards, so the released vector's noise would not be
        ``N(0, σ²R²I)`` (two shards' noises equal: their difference would be noise-free). One
        ``all_gather`` of a 56-bit hash of each rank's state (None: secure mode, nothing to
        compare)."""
        code = 0
        if generator is not None:
            state = generator.get_state().cpu().numpy().tobytes()
            code = int.from_bytes(hashlib.blake2b(state, digest_size=7).digest(), "little") + 1
        mine = torch.tensor([code], dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        codes = [int(t.item()) for t in everyone]
        if any(c and codes.count(c) > 1 for c in codes):
            raise ValueError(
                "noise_generator: the ranks' generators are in the same state, so the shards "
                "they noise would get the same noise. Under FSDP2 every rank draws the noise of "
                "its own rows: give each rank its own generator (or leave noise_generator=None "
                "for one seeded from OS entropy on each rank).")

    # -- parameters ------------------------------------------------------------------------------
    def unsharded_params(self, params: Sequence[nn.Parameter]) -> List[nn.Parameter]:
        """FSDP2's unsharded parameter object of each sharded parameter of ``params``: what the
        modules hold while they compute, hence what the clipping core keys on."""
        return [self._unsharded[id(p)] for p in params]

    def unit_of(self, unsharded: torch.Tensor) -> int:
        """Index of the FSDP2 unit (parameter group) of an unsharded parameter: the key of its
        flat buffer of clipped sums (one buffer per unit, freed once the unit is
        reduce-scattered, :meth:`release`)."""
        return self._unit_of_unsharded[id(unsharded)]

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """The whole-model path of a physical batch (module docstring): all-gather every FSDP2
        module (``FSDPModule.unshard``, in ``modules()`` order: the same collectives on every
        rank), run the body, reshard (no communication). Inside, every module
        holds its unsharded parameters, so the engine's backward passes — whose number per
        physical batch differs between ranks (an empty batch runs none, the separability probe
        runs on a rank's first batch of a new input signature with at least two samples) —
        communicate nothing: FSDP2's pre-backward all-gather is a no-op on unsharded modules and
        its post-backward reshard and gradient reduction are off."""
        for m in self.modules:
            m.unshard()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.modules[0].reset_iter_state()  # an aborted backward: FSDP2's states reset
            raise
        finally:
            for m in self.modules:
                m.reshard()

    def can_stream(self, clipper) -> bool:
        """Whether the clipper's physical batches can be clipped with FSDP2's per-unit
        all-gathers in the backward (:meth:`streaming`): a book-keeping mode (one backward; the
        clipped sums ``gᵀ·diag(C)·a`` come from the kept activations and output gradients)
        whose layer rules read only their modules' shapes (:func:`rules_without_weights`), each
        layer's parameters in one unit and dtype. Fixed at construction, the same on every
        rank."""
        return (_sums_need_no_weights(clipper, [layer.rule for layer in clipper.recorder.layers])
                and clipper.kept_layers_in_one_buffer())

    def agree(self, probe: bool, failed: bool) -> tuple:
        """One ``all_gather`` of two flags per physical batch, before any backward:
        ``(gather, failed ranks)``. ``gather``: some rank runs the separability probe on this
        batch (its extra backward passes would issue FSDP2 all-gathers the other ranks do not),
        so every rank clips this batch with the whole model gathered (:meth:`unsharded`);
        ``failed``: the ranks whose checks before the backward raised (every rank then raises
        before any collective of the backward)."""
        mine = torch.tensor([int(bool(probe)), int(bool(failed))], dtype=torch.int64,
                            device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        table = torch.stack(everyone).cpu().tolist()
        return any(row[0] for row in table), [r for r, row in enumerate(table) if row[1]]

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """FSDP2's own schedule for the engine's one backward of a physical batch: each unit is
        all-gathered by FSDP2's pre-backward hook and resharded after its backward (reshard
        after backward on inside, off again after; gradient reduction stays off). Every rank
        must run the same backward, an empty batch included (:meth:`empty_backward`).

        Inside, the modules hold FSDP2's unsharded parameter objects throughout — their storage
        freed while their unit is resharded — instead of the ``DTensor`` shards FSDP2 puts back
        at each reshard: everything the clipping core keys on a module's parameter (kept
        per-sample gradients, the kept layers' clipped sums, which read the parameters' shapes
        only) sees the one object it was built on, whichever of FSDP2's hooks runs first. The
        shards are put back on the way out."""
        for g in self._groups:
            g.reshard_after_backward = True
        for fp in self._fsdp.values():
            unsharded = fp._unsharded_param
            fp._setattr_on_modules(unsharded)
            fp._setattr_on_modules = _holding(fp, unsharded)
        try:
            yield
        finally:
            for g in self._groups:
                g.reshard_after_backward = False
            for fp in self._fsdp.values():
                del fp._setattr_on_modules  # FSDP2's own method again
            self.end_batch()  # every unit resharded (no communication)
            for fp in self._fsdp.values():  # the modules hold their shards again
                if fp.sharded_state.name == "SHARDED":
                    fp._setattr_on_modules(fp.sharded_param)

    def end_batch(self) -> None:
        """After every physical batch, on every rank (no communication): FSDP2's per-iteration
        state reset (``reset_iter_state`` on each root: every unit resharded, the order of the
        forward's units cleared). FSDP2 clears that order at the end of a backward; a rank that
        ran none on this batch (an empty batch with the model gathered) would keep it and
        prefetch other units than the other ranks in its next backward."""
        for m in self.modules:
            if getattr(m._get_fsdp_state(), "_is_root", False):
                m.reset_iter_state()

    @staticmethod
    def empty_backward(clipper, loss: torch.Tensor) -> None:
        """The norm pass's backward on a rank's empty batch: ``∂(Σ L)/∂`` (nothing) at the same
        graph edges as a non-empty batch's norm pass (the leading recorded calls, the tracer's
        entries), without recording, so that FSDP2's backward hooks issue the same per-unit
        all-gathers as on the other ranks. Zero rows: nothing is computed but the schedule."""
        try:
            walk = clipper.recorder.walk(loss, clipper.params)
            inputs = list(walk.leading_edges)
            if clipper.tracer is not None:
                inputs += clipper.tracer.entry_edges()
            if inputs:
                torch.autograd.grad(loss.sum(), inputs=inputs, allow_unused=True)
        finally:
            clipper.release()

    def free_gathered(self, clipper) -> None:
        """Free the storage of every unsharded parameter (FSDP2's ``free_unsharded_param``; the
        modules keep the parameter objects, the clipper's keys, and the reshard at the end of
        :meth:`unsharded` finds them freed) once the clip factors are known, when what is left —
        forming the clipped sums — reads no parameter's values: a book-keeping mode (one
        backward, already done: the sums ``gᵀ·diag(C)·a`` come from the kept activations and
        output gradients, the kept per-sample gradients are already formed) whose kept layers'
        rules read only their modules' shapes (:func:`rules_without_weights`). Otherwise (a
        two-pass mode's second backward, another rule) nothing is freed. The clipped sums of a
        physical batch and the gathered parameters are then never held together."""
        if not _sums_need_no_weights(clipper, [rule for _, rule, _ in clipper._kept_pairs]):
            return
        for fp in self._fsdp.values():
            fp.free_unsharded_param()

    def check_fsdp_state(self) -> None:
        """Before each clipping and release: FSDP2's gradient reduction and its reshard after
        backward are still off, its parameter objects are the ones the clipper was built on (a
        ``load_state_dict(assign=True)`` or ``to()`` that replaced them would leave the clipper
        keyed on stale tensors), and no raw gradient waits on an unsharded parameter (a
        ``loss.backward()`` of the user's: dropped, as the step would overwrite it on an
        unsharded model, so that FSDP2 never reduces it later)."""
        for g in self._groups:
            if g.reduce_grads or g.all_reduce_grads:
                raise RuntimeError(
                    "FSDP2's gradient reduction was switched back on "
                    "(set_requires_gradient_sync(True)): it would reduce raw, unclipped "
                    "gradients. The engine reduces the clipped sums itself; leave it off.")
            if g.reshard_after_backward:
                raise RuntimeError(
                    "FSDP2's reshard after backward was switched back on "
                    "(set_reshard_after_backward(True)): the engine switches it on for the "
                    "backward passes that FSDP2 schedules unit by unit and off for those that "
                    "need the whole model gathered, and reshards itself. Leave it off while "
                    "the engine is attached. Nothing was updated.")
        self.drop_raw_grads()
        for k, fp in self._fsdp.items():
            if id(fp.sharded_param) != k or fp._unsharded_param is not self._unsharded[k]:
                raise RuntimeError(
                    "FSDP2 replaced a parameter object after the engine was built (e.g. "
                    "load_state_dict(assign=True) or module.to()): build the engine again.")

    # -- shard sums -----------------------------------------------------------------------------
    def _shard_layout(self, params: Sequence[nn.Parameter]) -> "_ShardLayout":
        """The layout of the per-rank shard sums of ``params`` (the sharded parameters, in the
        engine's order), built once."""
        key = tuple(id(p) for p in params)
        if getattr(self, "_layout_key", None) != key:
            self._layout = _ShardLayout([self._fsdp[id(p)] for p in params],
                                        [self._unit[id(self._fsdp[id(p)])] for p in params],
                                        [self._unsharded[id(p)] for p in params])
            self._layout_key = key
        return self._layout

    def new_shard_sums(self, params: Sequence[nn.Parameter]) -> GradSums:
        """Empty shard sums of ``params``: one slot per (unit, dtype), filled by
        :meth:`scatter_unit`."""
        layout = self._shard_layout(params)
        return GradSums(grads=cast(List[torch.Tensor], [None] * len(params)),
                        buffers=cast(List[torch.Tensor], [None] * len(layout.keys)),
                        layout=layout)

    def scatter_unit(self, sums: GradSums, i: int,
                     full: Dict[int, torch.Tensor]) -> None:
        """Reduce-scatter the full-size clipped sums ``full`` (``{engine index: tensor}``, every
        parameter of slot ``i``, one unit and dtype; a missing one counts as zero) into this
        rank's rows of ``Σ_q s_q``: the unit's sums laid out rank-major — row q holds, for every
        parameter, its FSDP2 chunk q zero-padded to the padded chunk size — and reduced by one
        ``reduce_scatter(SUM)`` (summing and cutting into shards commute). The received rows
        become ``sums.buffers[i]``, the parameters' shard views ``sums.grads[k]``."""
        layout = cast(_ShardLayout, sums.layout)
        _, device, dtype, ks, sizes = layout.keys[i]
        W = self.world_size
        send = torch.zeros(W, sum(sizes), device=device, dtype=dtype)
        offset = 0
        for k, size in zip(ks, sizes):
            g = full.get(k)
            if g is not None:
                flat = g.reshape(-1)
                for q in range(W):
                    lo, hi = q * size, min(flat.numel(), (q + 1) * size)
                    if hi > lo:
                        send[q, offset:offset + hi - lo].copy_(flat[lo:hi])
            offset += size
        mine = torch.empty(sum(sizes), device=device, dtype=dtype)
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        reduce_scatter(mine, send.reshape(-1), op=dist.ReduceOp.SUM)
        del send
        sums.buffers[i] = mine
        offset = 0
        for k, size in zip(ks, sizes):
            fp = layout.fsdp[k]
            self._own_rows(fp)
            sums.grads[k] = mine[offset:offset + fp.sharded_size.numel()].view(fp.sharded_size)
            offset += size

    def scatter(self, full: GradSums, params: Sequence[nn.Parameter]) -> GradSums:
        """Shard sums (:meth:`new_shard_sums`) of a physical batch's full-size sums ``full``
        (``full.grads`` in the order of ``params``), one unit and dtype at a time in the layout's
        order (the same on every rank); ``full`` is consumed: each unit's full-size sums are
        dropped once reduced, their flat buffer when it is empty."""
        sums = self.new_shard_sums(params)
        layout = cast(_ShardLayout, sums.layout)
        grads = [g if g.dtype == accumulation_dtype(g) else g.to(accumulation_dtype(g))
                 for g in full.grads]
        buffer_of = {b.untyped_storage().data_ptr(): j for j, b in enumerate(full.buffers)
                     if b is not None and b.numel()}
        where = [buffer_of.get(g.untyped_storage().data_ptr()) if g.numel() else None
                 for g in full.grads]
        left = [where.count(j) for j in range(len(full.buffers))]
        for i, (_, _, _, ks, _) in enumerate(layout.keys):
            self.scatter_unit(sums, i, {k: grads[k] for k in ks})
            for k in ks:
                grads[k] = full.grads[k] = None
                if where[k] is not None:
                    left[where[k]] -= 1
                    if left[where[k]] == 0:
                        full.buffers[where[k]] = None
        return sums

    def sums_sink(self, sums: GradSums):
        """The ``sink`` of :meth:`PerSampleClipper.clipped_sums_by_buffer` that reduce-scatters
        each unit's full-size sums into ``sums`` as soon as they are formed, and its ``order``
        (the units' slot order, the same on every rank)."""
        layout = cast(_ShardLayout, sums.layout)

        def sink(key, unsharded, views):
            i = layout.slot_of(key[0], key[2])
            self.scatter_unit(sums, i, {layout.index_of[id(u)]: v
                                        for u, v in zip(unsharded, views)})

        def order(key):
            return layout.slot_of(key[0], key[2])

        return sink, order

    def fill_missing(self, sums: GradSums) -> GradSums:
        """Reduce-scatter zeros into every slot of ``sums`` still empty (a unit no buffer of the
        batch covered), so that every rank runs the same reduce-scatters."""
        for i, b in enumerate(sums.buffers):
            if b is None:
                self.scatter_unit(sums, i, {})
        return sums

    # -- the release -----------------------------------------------------------------------------
    def release(self, sums: GradSums, params: Sequence[nn.Parameter], std: float,
                expected_batch_size: int, generator: Optional[torch.Generator] = None,
                secure_mode: bool = False) -> List[torch.Tensor]:
        """``[(shard_r(Σ_q s_q) + σR·ξ_r) / B]``: from the shard sums ``sums`` of the logical
        batch (this rank's rows of the ranks' summed clipped sums, :meth:`scatter_unit`), rank
        r's noisy rows of every parameter of ``params`` (the sharded ``DTensor`` parameters) as
        ``DTensor`` gradients of the parameters' own placement, each on storage of its own.

        One unit and dtype at a time: ``σR·ξ_r`` is added to the real (unpadded) rows only, the
        rows are divided by B in place and copied to the parameter's dtype, and the unit's slot
        of ``sums`` is dropped (``sums`` is consumed)."""
        from torch.distributed.tensor import DTensor

        self.check_fsdp_state()
        layout = cast(_ShardLayout, sums.layout)
        if not isinstance(layout, _ShardLayout):
            raise RuntimeError("internal error: the FSDP2 release needs shard sums.")
        out: List[Optional[torch.Tensor]] = [None] * len(params)
        for i, (_, _, _, ks, _) in enumerate(layout.keys):
            views = [sums.grads[k] for k in ks]
            if std > 0:
                add_gaussian_noise([v for v in views if v.numel()], std, generator, secure_mode)
            torch._foreach_div_(views, float(expected_batch_size))
            for k, v in zip(ks, views):
                p = params[k]
                g = v.to(p.dtype, copy=True).contiguous()
                sums.grads[k] = None
                out[k] = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            del views
            sums.buffers[i] = None
        return out

    def _own_rows(self, fp) -> int:
        """Rows of the parameter this rank owns: ``max(0, min(d₀, (r+1)c) − r·c)``, checked against
        FSDP2's shard size (the layout of the reduce-scatter must be FSDP2's)."""
        d0, c = fp._orig_size[0], fp.padded_sharded_param_size[0]
        rows = max(0, min(d0, (self.rank + 1) * c) - self.rank * c)
        if rows != fp.sharded_size[0]:
            raise RuntimeError(f"internal error: FSDP2's shard of {fp} has {fp.sharded_size[0]} "
                               f"rows on rank {self.rank}, expected {rows}.")
        return rows

    # -- replicas --------------------------------------------------------------------------------
    @torch.no_grad()
    def broadcast_module(self, model: nn.Module) -> None:
        """``b ← b of rank 0`` for every buffer (FSDP2 shards parameters, not buffers; the
        parameters are not replicas: each rank's shard is its own)."""
        for b in model.buffers():
            tmp = b.data.contiguous()
            dist.broadcast(tmp, src=0)
            if tmp is not b.data:
                b.data.copy_(tmp)

    def check_replicas(self, params) -> None:
        raise _refuse("check_replicas=True", "the ranks hold different shards, not replicas")


def _holding(fp, unsharded: nn.Parameter):
    """A stand-in for ``FSDPParam._setattr_on_modules`` that puts ``unsharded`` on the modules
    whatever FSDP2 asks for (:meth:`ShardedDataParallel.streaming`)."""
    original = type(fp)._setattr_on_modules

    def setattr_on_modules(param):
        original(fp, unsharded)

    return setattr_on_modules


class _ShardLayout:
    """Where each rank's shard sums sit: one slot per (FSDP2 unit, accumulation dtype), in unit
    order (the same on every rank), holding the rank's padded rows of the slot's parameters
    (FSDP2's padded chunk each, engine order); one object per engine, so that the shard sums of
    two physical batches add slot by slot (:meth:`GradSums.add_`)."""

    def __init__(self, fsdp_params: list, units: List[int], unsharded: List[torch.Tensor]):
        self.fsdp = fsdp_params
        self.index_of = {id(u): k for k, u in enumerate(unsharded)}
        slots: Dict[tuple, List[int]] = {}
        for k, (u, t) in enumerate(zip(units, unsharded)):
            slots.setdefault((u, accumulation_dtype(t)), []).append(k)
        #: [(unit, device, dtype, engine indices, padded chunk sizes)]
        self.keys = []
        for (u, dtype), ks in sorted(slots.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            self.keys.append((u, unsharded[ks[0]].device, dtype, ks,
                              [fsdp_params[k].padded_sharded_param_size.numel() for k in ks]))
        self._slot = {(u, dtype): i for i, (u, _, dtype, _, _) in enumerate(self.keys)}

    def slot_of(self, unit: int, dtype: torch.dtype) -> int:
        return self._slot[(unit, dtype)]


__all__ = ["ShardedDataParallel", "fsdp1_names", "fsdp2_modules"]
