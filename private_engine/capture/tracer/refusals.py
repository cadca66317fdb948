"""The parameter-entry tracer's refusals: :class:`UnsupportedEntryError` and its messages (a
tracked parameter meeting the batch in an op it cannot clip per sample, a reparametrized weight)."""
from __future__ import annotations

from typing import Optional


def reparametrization_message(names) -> Optional[str]:
    """The refusal for parameters that are a module's reparametrization — ``torch.nn.utils.
    parametrize`` (``parametrizations.weight.original*``, e.g. ``parametrizations.weight_norm``)
    or the older hook-based ``torch.nn.utils.weight_norm`` (``weight_g``, ``weight_v``) — naming
    the module and the fix; ``None`` for other parameters."""
    owners: dict = {}
    for n in names:
        if ".parametrizations." in f".{n}":
            head, _, rest = f".{n}".partition(".parametrizations.")
            owners.setdefault(head[1:], ("parametrize", rest.split(".")[0]))
        elif n.endswith(("weight_g", "weight_v")) and "." in n:
            owners.setdefault(n.rsplit(".", 1)[0], ("weight_norm", "weight"))
    if not owners:
        return None
    kind = {k for k, _ in owners.values()}
    mods = ", ".join(f"the {a} of module {m!r}" for m, (_, a) in sorted(owners.items()))
    fixes = ("fold it into a plain parameter before training "
             "(torch.nn.utils.parametrize.remove_parametrizations(module, name)), or clip the "
             "module by the torch.func fallback: private_engine.layers.register_fallback("
             "type(module)) before building the engine (a parametrized module has its own class, "
             "e.g. ParametrizedLinear)" if kind == {"parametrize"} else
             "fold it into a plain weight before training (torch.nn.utils.remove_weight_norm("
             "module)), or use torch.nn.utils.parametrizations.weight_norm and clip the module by "
             "the torch.func fallback: private_engine.layers.register_fallback(type(module))")
    return (f"parameter(s) {names} reparametrize {mods}: the module computes that tensor from "
            "them in its forward (torch.nn.utils.parametrize / weight_norm), so its "
            "layer rule, which clips a weight that is itself a parameter, does not apply, and the "
            f"parameter-entry tracer cannot follow the computed weight into the layer. Fix: "
            f"{fixes}; or freeze them (requires_grad_(False)).")


class UnsupportedEntryError(ValueError):
    """A tracked parameter reaches the batch through an op the tracer cannot clip per sample."""


def unsupported_entry(func, names, why) -> UnsupportedEntryError:
    """The refusal for parameters ``names`` meeting the batch in ``func`` (``why``: what went
    wrong), naming the supported entries and the fixes."""
    reparametrized = reparametrization_message(names)
    if reparametrized:
        return UnsupportedEntryError(reparametrized)
    return UnsupportedEntryError(
        f"parameter(s) {names} meet the batch in {getattr(func, '__name__', func)!r}: {why}. "
        "The parameter-entry tracer clips parameters that reach the batch by elementwise ops "
        "(add/sub/mul/div/where), cat/stack of a batch-expanded token, or "
        "F.scaled_dot_product_attention(attn_mask=...). Clip the module that owns them with "
        "the torch.func fallback instead: private_engine.layers.register_fallback(ModuleClass) "
        "before building the engine, or freeze them (requires_grad_(False))."
    )
