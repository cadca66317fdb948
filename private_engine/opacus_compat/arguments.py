"""What ``make_private`` refuses before anything is built: Opacus' own argument errors (same
exception classes), what the Opacus door does not run (FSDP, torch DDP options whose gradient
all-reduce cannot be turned off), and a ``DPMultiheadAttention`` whose layout contradicts
``batch_first``."""
from __future__ import annotations

from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel

#: grad_sample_mode strings accepted by opacus 1.6 (what each runs: :mod:`.engine`)
GRAD_SAMPLE_MODES = frozenset({"hooks", "functorch", "ew", "no_op", "ghost", "ghost_fsdp"})


def check_arguments(*, module, optimizer, noise_multiplier, max_grad_norm, batch_first,
                     loss_reduction, clipping, grad_sample_mode, wrap_model,
                     rand_on_empty) -> None:
    """Reject, before anything is built, what Opacus rejects (same exception class) or what we
    do not run."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}.")
    if not isinstance(optimizer, optim.Optimizer):
        raise TypeError("optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}.")
    from torch.distributed._composable.fsdp import FSDPModule  # opacus checks this class too
    if isinstance(module, FSDPModule) or grad_sample_mode == "ghost_fsdp":
        raise ValueError(
            "FSDP (fully_shard, grad_sample_mode='ghost_fsdp') is not supported by "
            "private_engine's make_private (docs/distributed.md, 'FSDP'). For data-parallel "
            "training wrap the model in opacus' DifferentiallyPrivateDistributedDataParallel "
            "(or torch's DistributedDataParallel) and use grad_sample_mode 'hooks' or 'ghost'.")
    if isinstance(module, DistributedDataParallel):
        check_ddp(module)
    mine = {id(p) for p in module.parameters()}
    if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("Module parameters are different than optimizer Parameters: the "
                         "optimizer updates tensors that are not the module's. Build the "
                         "optimizer from module.parameters().")
    updated = {id(p) for g in optimizer.param_groups for p in g["params"]}
    left_out = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in updated]
    if left_out:
        raise ValueError(
            f"trainable parameters {left_out} are not updated by the optimizer. Opacus would clip "
            "by the norm over the optimizer's parameters only, private_engine over all trainable "
            "ones; freeze them (requires_grad_(False)) or add them to the optimizer.")
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"Unexpected grad_sample_mode: {grad_sample_mode}. Allowed values: "
                         f"{', '.join(sorted(GRAD_SAMPLE_MODES))}.")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
    if clipping not in ("flat", "per_layer", "adaptive"):
        raise ValueError(f"Unexpected clipping={clipping!r}: use 'flat', 'per_layer' or "
                         "'adaptive'.")
    if clipping == "per_layer":
        if "ghost" in grad_sample_mode:
            raise ValueError(f"Unsupported combination of parameters. Clipping: {clipping} and "
                             f"grad_sample_mode: {grad_sample_mode}; use grad_sample_mode='hooks' "
                             "for per-layer clipping.")
        if (not isinstance(max_grad_norm, (list, tuple))
                or not all(positive(r) for r in max_grad_norm)):
            raise ValueError("clipping='per_layer' needs max_grad_norm as a list of positive "
                             "numbers, one per optimizer parameter tensor.")
    elif not positive(max_grad_norm):
        raise ValueError(f"max_grad_norm must be a positive number for clipping={clipping!r}, "
                         f"got {max_grad_norm!r} (a list is for clipping='per_layer').")
    if (isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float))
            or noise_multiplier < 0):
        raise ValueError(f"noise_multiplier must be a number ≥ 0, got {noise_multiplier!r}.")


def is_data_parallel(module: nn.Module) -> bool:
    """Opacus' ``DifferentiallyPrivateDistributedDataParallel`` or torch's
    ``DistributedDataParallel``: make_private hooks ``module.module`` and runs the distributed
    optimizer (Opacus' ``make_private`` sets ``distributed`` for these classes)."""
    return isinstance(module, (DPDDP, DistributedDataParallel))


def check_ddp(ddp: DistributedDataParallel) -> None:
    """torch DDP is used for its forward only: :class:`~.module.PrivateModule` turns its backward
    all-reduce off (``require_backward_grad_sync``), since the reducer would average raw,
    unclipped gradients into ``p.grad``; the DP optimizer all-reduces the clipped sums. Options
    whose gradient communication does not obey that switch are refused."""
    refused = [name for name, on in (
        ("static_graph=True", ddp.static_graph),
        ("delay_all_reduce_named_params", bool(getattr(ddp, "_delay_all_reduce_params", ()))),
        ("mixed_precision", getattr(ddp, "mixed_precision", None) is not None),
        ("the python reducer (compiled DDP)", getattr(ddp, "_use_python_reducer", False)),
    ) if on]
    if refused:
        raise ValueError(
            f"DistributedDataParallel with {', '.join(refused)} is not supported by "
            "private_engine's make_private: its gradient all-reduce cannot be turned off, and it "
            "would mix raw, unclipped gradients into p.grad. Wrap the model with opacus' "
            "DifferentiallyPrivateDistributedDataParallel instead (or DDP without these "
            "options).")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def check_attention_layout(module: nn.Module, batch_first: bool) -> None:
    """A DPMultiheadAttention's linear maps see its own layout: it must match ``batch_first``."""
    from opacus.layers import DPMultiheadAttention
    for name, m in module.named_modules():
        if isinstance(m, DPMultiheadAttention) and m.batch_first != batch_first:
            raise ValueError(
                f"{name} is a DPMultiheadAttention with batch_first={m.batch_first} but "
                f"make_private got batch_first={batch_first}; its linear maps would see the batch "
                f"in the wrong dimension. Construct it with batch_first={batch_first} (and give "
                "inputs in that layout).")
