"""Model checks done before training starts — which module clips each trainable parameter, and
what cannot be clipped per sample (BatchNorm, running statistics, shared parameters, uncertified
rules) — and the BatchNorm fix helper that removes what those checks refuse."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..layers.base import LayerRule
from ..layers.recurrent import check_no_recurrent
from ..layers.registry import find_rule, overrides_ruled_class, uses_fallback
from ..layers.ruled import RuledLayer
from .buffers import check_no_running_stats, drop_running_stats


def batchnorm_modules(model: nn.Module) -> List[str]:
    """Names of BatchNorm modules (their batch statistics mix samples, so no per-sample gradient
    exists)."""
    return [name or type(model).__name__ for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def check_no_batchnorm(model: nn.Module) -> None:
    """Refuse BatchNorm, then every other module whose buffers track statistics of the data, then
    torch's fused recurrent layers.

    BatchNorm mixes samples (no per-sample gradient exists); the others (InstanceNorm with
    ``track_running_stats=True``, …: ``private_engine.guards.buffers.check_no_running_stats``)
    would release running statistics of the private batches without noise in the ``state_dict``;
    ``nn.LSTM``/``nn.GRU``/``nn.RNN`` have exact replacements
    (``private_engine.layers.recurrent.check_no_recurrent``, ``fix_recurrent``).
    """
    bns = batchnorm_modules(model)
    if bns:
        shown = ", ".join(bns[:8]) + (f", … ({len(bns)} in all)" if len(bns) > 8 else "")
        raise ValueError(
            f"the model has BatchNorm layers ({shown}); BatchNorm mixes samples through batch "
            "statistics, so "
            "per-sample clipping is not defined. Replace them with GroupNorm: "
            "model = private_engine.fix_batchnorm(model)."
        )
    check_no_running_stats(model)
    check_no_recurrent(model)


def fix_batchnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm by GroupNorm, stop InstanceNorm tracking running statistics, then
    apply Opacus' ``ModuleValidator.fix``; returns the model.

    ``GroupNorm(gcd(num_groups, C), C)`` normalises each sample on its own, so per-sample
    gradients exist. Frozen BatchNorms are replaced too (their batch statistics mix samples all the
    same), by a GroupNorm that stays frozen. timm's ``BatchNormAct2d`` (BatchNorm + activation)
    becomes ``Sequential(norm=GroupNorm, drop, act)`` with the same dropout and activation: a plain
    GroupNorm whose own output gradient the engine sees (timm's ``GroupNormAct`` applies the
    activation inside the norm module, so its output gradient is taken after the activation and the
    GroupNorm rule does not hold for it).

    InstanceNorm with ``track_running_stats=True`` becomes ``track_running_stats=False``, its
    running buffers removed (``private_engine.guards.buffers.drop_running_stats``): training is
    unchanged (in training mode it normalises each sample by its own statistics anyway), but in
    eval mode it then normalises by the sample's own statistics too, not by running estimates.
    """
    from opacus.validators import ModuleValidator

    model = _replace_batchnorm(model, num_groups)
    drop_running_stats(model)  # before Opacus' fix, which turns the flag off but keeps the buffers
    model = ModuleValidator.fix(model)
    check_no_batchnorm(model)
    return model


def _replace_batchnorm(model: nn.Module, num_groups: int) -> nn.Module:
    # Opacus' ModuleValidator.fix only replaces *trainable* BatchNorms, so frozen ones are replaced
    # here: otherwise the check after it would ask the user to call fix_batchnorm, the very function
    # that returned the model.
    try:
        from timm.layers import BatchNormAct2d
    except ImportError:  # pragma: no cover - timm is a dependency
        BatchNormAct2d = ()  # type: ignore[misc,assignment]  # isinstance(x, ()) is False
    from collections import OrderedDict

    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            C = child.num_features
            norm: nn.Module = nn.GroupNorm(math.gcd(C, num_groups), C, eps=child.eps,
                                           affine=child.affine)
            like = next((t for t in (*child.parameters(), *child.buffers())
                         if t.is_floating_point()), None)
            if like is not None:  # same device and dtype as the layer it replaces
                norm.to(device=like.device, dtype=like.dtype)
            if child.affine:
                norm.requires_grad_(child.weight.requires_grad)
            if isinstance(child, BatchNormAct2d):
                norm = nn.Sequential(OrderedDict(norm=norm, drop=child.drop, act=child.act))
            setattr(model, name, norm)
        else:
            _replace_batchnorm(child, num_groups)
    return model


def _renamed_aliases(module: nn.Module) -> frozenset:
    """Names under which an Opacus ``RenameParamsMixin`` (DPLSTM, DPGRU, DPRNN) re-registers its
    submodules' parameters for nn.LSTM-compatible state dicts: the same tensors, used only by the
    submodules (``RNNLinear``), so they are clipped there and skipped here."""
    try:
        from opacus.layers.param_rename import RenameParamsMixin
    except ImportError:  # pragma: no cover - opacus is a dependency
        return frozenset()
    if isinstance(module, RenameParamsMixin):
        return frozenset(getattr(module, "new_to_old", {}))
    return frozenset()


@dataclass
class ModelScan:
    """Who clips each trainable parameter of a model (:func:`scan_model`)."""

    #: ``[(name, module, rule)]``: modules whose direct trainable parameters a layer rule covers
    layers: List[RuledLayer]
    #: ``[(qualified name, parameter)]``: parameters clipped by the parameter-entry tracer
    traced: List[Tuple[str, nn.Parameter]]
    #: ``[(name, module)]``: modules clipped by the torch.func fallback (their whole subtree)
    fallbacks: List[Tuple[str, nn.Module]]
    #: ``{id(parameter): [qualified names]}``: more than one name means a shared parameter
    owners: Dict[int, List[str]]


def scan_model(model: nn.Module) -> ModelScan:
    """Who clips each trainable parameter.

    * ``layers = [(name, module, rule)]``: modules whose direct trainable parameters a layer rule
      covers;
    * ``traced = [(qualified name, param)]``: other direct parameters (tokens, pos_embed, gammas,
      bias tables, …), clipped by the parameter-entry tracer (private_engine.capture.tracer);
    * ``fallbacks = [(name, module)]``: modules of a class registered for the torch.func fallback
      (private_engine.capture.fallback), and subclasses of a ruled layer that override its forward
      (timm's LayerNorm2d, StdConv2d, …); they clip every trainable parameter of their subtree.
    """

    layers: List[RuledLayer] = []
    traced: List[Tuple[str, nn.Parameter]] = []
    fallbacks: List[Tuple[str, nn.Module]] = []
    owners: Dict[int, List[str]] = {}
    inside: List[str] = []  # prefixes of fallback subtrees
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if any(f == "" or name == f or name.startswith(f + ".") for f in inside):
            continue
        if (uses_fallback(module) or overrides_ruled_class(module)) and \
                any(p.requires_grad for p in module.parameters()):
            fallbacks.append((name, module))
            inside.append(name)
            for pname, p in module.named_parameters():
                if p.requires_grad:
                    owners.setdefault(id(p), []).append(prefix + pname)
            continue
        aliases = _renamed_aliases(module)
        own = [(pname, p) for pname, p in module.named_parameters(recurse=False)
               if p.requires_grad and pname not in aliases]
        if not own:
            continue
        rule = find_rule(module)
        covered = set(rule.param_names) if rule is not None else set()
        for pname, p in own:
            owners.setdefault(id(p), []).append(prefix + pname)
        missing = [(prefix + pname, p) for pname, p in own if pname not in covered]
        traced.extend(missing)
        if rule is not None and len(missing) < len(own):  # (no rule: every parameter missing)
            layers.append(RuledLayer(name, module, rule))
    # an attribute of another module that is a ruled layer's own parameter (BERT's
    # ``cls.predictions.bias``, the decoder's bias) is an alias: clipped by that layer; a direct
    # use outside the layer's forward is refused at the first step (the graph walk)
    ruled = {id(p) for _, _, _, p in ruled_parameters(layers)}
    alias_names = {n for n, p in traced if id(p) in ruled}
    traced = [(n, p) for n, p in traced if n not in alias_names]
    for names in owners.values():
        names[:] = [n for n in names if n not in alias_names]
    return ModelScan(layers, traced, fallbacks, owners)


def check_certifiable(name: str, module: nn.Module, rule: LayerRule) -> None:
    """A rule's ``certified_norm_sq`` must be written for the ``weighted_grads`` it runs: a rule (or
    a subclass of a built-in rule) that overrides the clipped sum must say how large what it
    releases can be, or the engine could not bound a sample's release, rounding included."""
    cls = type(rule)
    def defined_in(attr):
        return next(k for k, c in enumerate(cls.__mro__) if attr in vars(c))

    # the certificate must be written for this release: defined at or below the class whose
    # weighted_grads runs (a subclass overriding only weighted_grads inherits a bound of another
    # sum)
    if defined_in("certified_norm_sq") > defined_in("weighted_grads"):
        raise ValueError(
            f"the layer rule {cls.__name__} (for {name or type(module).__name__}: "
            f"{type(module).__name__}) overrides weighted_grads but not certified_norm_sq, so the "
            "engine cannot certify how far one sample moves its clipped sum. Implement "
            "certified_norm_sq (an upper bound of the released per-sample norm², rounding "
            "included; see private_engine.layers.rounding) or drop the weighted_grads override.")


def check_rule_signature(name: str, module: nn.Module, rule: LayerRule) -> None:
    """A rule's ``weighted_grads(module, calls, factors, out=None)`` must accept ``out=``: the
    clipped sums are written straight into the flat buffers the private step noises."""
    try:
        params = inspect.signature(type(rule).weighted_grads).parameters
    except (TypeError, ValueError):
        return  # not introspectable (a builtin): trusted
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "out" not in params and not takes_kwargs:
        raise ValueError(
            f"the layer rule {type(rule).__name__} (for {name or type(module).__name__}) defines "
            "weighted_grads without the out= argument; write it as weighted_grads(self, module, "
            "calls, factors, out=None) and write each sum into out[name] when it is given "
            "(see private_engine.layers.base.LayerRule).")


def traced_parameters(model: nn.Module) -> List[str]:
    """Names of trainable parameters clipped by the parameter-entry tracer (no layer rule covers
    them)."""
    return [n for n, _ in scan_model(model).traced]


def fallback_modules(model: nn.Module) -> List[str]:
    """Names of modules clipped by the torch.func fallback."""
    return [n or type(model).__name__ for n, _ in scan_model(model).fallbacks]


def clipped_layers(model: nn.Module, strict: bool = True,
                   scan: Optional[ModelScan] = None) -> List[RuledLayer]:
    """``[(name, module, rule)]`` for every module whose direct trainable parameters a rule covers.

    With ``strict``, rules check their module, and a parameter shared between modules is checked
    by :func:`check_shared_parameters` (tied weights of ruled layers are clipped together; any
    other sharing raises, never silently clipped twice or left unclipped). Parameters without a
    rule are not listed here: see :func:`scan_model` (tracer and fallback); pass its ``scan`` to
    avoid a second scan.
    """
    scan = scan_model(model) if scan is None else scan
    layers = scan.layers
    if not strict:
        return layers
    for name, module, rule in layers:
        rule.check(module)
        check_certifiable(name, module, rule)
        check_rule_signature(name, module, rule)
    check_shared_parameters(scan)
    return layers


def ruled_parameters(layers: Sequence[RuledLayer]
                     ) -> List[Tuple[str, nn.Module, str, nn.Parameter]]:
    """``[(layer name, module, parameter name, parameter)]``: the parameters the rules of
    ``layers`` cover (frozen ones included), one entry per use of a tensor."""
    return [(name, module, pname, getattr(module, pname)) for name, module, rule in layers
            for pname in rule.param_names
            if isinstance(getattr(module, pname, None), nn.Parameter)]


def tied_layers(layers: Sequence[RuledLayer]) -> List[List[str]]:
    """Groups of ruled layers that share a trainable parameter (tied weights: GPT-2's ``wte`` and
    ``lm_head``, BERT's word embeddings and MLM decoder), as lists of layer names; layers linked
    through a chain of shared parameters form one group.

    The per-sample gradient of a shared tensor is the sum of its uses,
    ``∂L_i/∂W = Σ_k ∂L_i/∂W|_k``, so its squared norm has cross terms
    ``2·Σ_{k<l} ⟨∂L_i/∂W|_k, ∂L_i/∂W|_l⟩``: the clipping core forms the norm of the sum, never
    the sum of the norms (:mod:`private_engine.clipping.tied`)."""
    parent = {name: name for name, _, _ in layers}

    def root(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    seen: Dict[int, str] = {}
    for name, _, _, p in ruled_parameters(layers):
        if not p.requires_grad:
            continue
        if id(p) in seen:
            parent[root(name)] = root(seen[id(p)])
        else:
            seen[id(p)] = name
    groups: Dict[str, List[str]] = {}
    for name, _, _ in layers:
        groups.setdefault(root(name), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def check_shared_parameters(scan: ModelScan) -> None:
    """Refuse a trainable parameter shared between modules unless every use is a ruled layer's
    own parameter (tied weights, clipped together by the clipping core). A parameter shared with
    the parameter tracer or a ``torch.func`` fallback module would be normed in two places
    without its cross terms: refused, naming it and its owners."""
    ruled: Dict[int, List[str]] = {}
    for name, _, pname, p in ruled_parameters(scan.layers):
        if p.requires_grad:
            ruled.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    bad = [names for pid, names in scan.owners.items()
           if len(names) > 1 and len(ruled.get(pid, ())) != len(names)]
    if bad:
        raise ValueError(
            "parameters shared between modules can be clipped only when every module using them "
            "has a layer rule (tied Linear/Embedding/Conv/norm weights); these are shared with a "
            f"module clipped by the parameter tracer or the torch.func fallback: {bad}. Untie "
            "them or freeze them (requires_grad_(False)).")
