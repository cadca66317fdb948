"""The methods compared: non-private training, private_engine's clipping modes, Opacus'
``make_private`` flows and the same flows through private_engine's Opacus door (drop-in). Each
``setup`` turns a model and a batch into a :class:`Runner` whose ``step()`` is one full training
step; ``SETUPS`` maps every method name to its setup."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List

from .config import AMP_DTYPES, FROZEN, METHODS, OUR_MODES, SAMPLE_SIZE
from .models import build_model, inplace_activations_off, make_batch


def autocast(args):
    """The forward's autocast context for ``--amp`` (a no-op with ``--amp none``)."""
    import torch

    if args.amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(args.device, dtype=getattr(torch, AMP_DTYPES[args.amp]))


def grad_scaler(args):
    """A GradScaler for ``--amp fp16``, else None."""
    import torch

    return torch.amp.GradScaler(args.device) if args.amp == "fp16" else None


@dataclass
class Runner:
    """One method, ready to train: ``step()`` runs one full training step; ``describe()`` notes
    after the run."""

    step: Callable[[], None]
    describe: Callable[[], str] = lambda: ""


def sgd(model, args):
    import torch

    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr)


def setup_nondp(model, x, y, args) -> Runner:
    import torch.nn.functional as F

    opt = sgd(model, args)
    scaler = grad_scaler(args)

    def step():
        with autocast(args):
            out = model(x)
        backward_and_step(F.cross_entropy(out.float(), y), opt, scaler)

    return Runner(step)


def backward_and_step(loss, opt, scaler) -> None:
    """``loss.backward(); opt.step(); opt.zero_grad()``, through the GradScaler when there is one
    (fp16)."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)


def setup_ours(mode: str):
    def setup(model, x, y, args) -> Runner:
        import torch.nn.functional as F

        import private_engine

        opt = sgd(model, args)
        engine = private_engine.PrivacyEngine(model, batch_size=args.batch_size,
                                              sample_size=SAMPLE_SIZE,
                                              max_grad_norm=args.max_grad_norm,
                                              noise_multiplier=args.noise_multiplier,
                                              clipping_mode=mode, grad_scaler=grad_scaler(args),
                                              check_sampling=False)  # fixed batches: timing
        engine.attach(opt)

        def step():
            with autocast(args):
                out = model(x)
            opt.step(loss=F.cross_entropy(out.float(), y, reduction="none"))
            opt.zero_grad(set_to_none=True)

        def describe():
            plan = engine.layer_plan
            n_ghost = sum(d.use_ghost for d in plan)
            return f"{n_ghost} ghost / {len(plan) - n_ghost} instantiated layers"

        return Runner(step, describe)

    return setup


def setup_opacus(grad_sample_mode: str, dropin: bool = False):
    """Opacus' loop; with ``dropin`` the engine is ``private_engine.opacus_compat.PrivacyEngine``
    (the Opacus-compatible door: Opacus users change only that import)."""
    def setup(model, x, y, args) -> Runner:
        import torch
        if dropin:
            from private_engine.opacus_compat import PrivacyEngine as OpacusEngine
        else:
            from opacus import PrivacyEngine as OpacusEngine
        from torch.utils.data import DataLoader, TensorDataset

        inplace_off = [] if dropin else inplace_activations_off(model)
        opt = sgd(model, args)
        # The loader only tells Opacus the sampling rate and expected batch size (= batch_size);
        # the benchmark feeds the fixed batch itself, as for the other methods.
        loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
        # the door refuses a batch-mean loss's plain backward in 16-bit precision (its 1/n is
        # rounded per batch size): that flow backpropagates the sum there (the same work)
        sixteen_bit = args.amp != "none" or args.dtype != "float32"
        reduction = "sum" if dropin and grad_sample_mode != "ghost" and sixteen_bit else "mean"
        criterion = torch.nn.CrossEntropyLoss(reduction=reduction)
        out = OpacusEngine().make_private(module=model, optimizer=opt, data_loader=loader,
                                          criterion=criterion,
                                          noise_multiplier=args.noise_multiplier,
                                          max_grad_norm=args.max_grad_norm,
                                          grad_sample_mode=grad_sample_mode,
                                          poisson_sampling=False, loss_reduction=reduction)
        if grad_sample_mode == "ghost":
            dp_model, dp_opt, criterion, _ = out  # criterion's backward() runs both passes
        else:
            dp_model, dp_opt, _ = out

        scaler = grad_scaler(args)

        def step():
            with autocast(args):
                out = dp_model(x)
            backward_and_step(criterion(out.float(), y), dp_opt, scaler)

        def describe():
            if dropin:  # docs/migrating-from-opacus.md, "grad_sample_mode mapping"
                return ("criterion flow: one backward, book-keeping" if grad_sample_mode == "ghost"
                        else "plain backward: book-keeping, one backward")
            ft = opacus_functorch_modules(dp_model)
            notes = [f"functorch (vmap) per-sample gradients for: {', '.join(ft)}"] if ft else []
            if inplace_off:
                notes.append(f"in-place activations off ({len(inplace_off)} modules: Opacus' "
                             "backward hooks reject them)")
            return "; ".join(notes)

        return Runner(step, describe)

    return setup


def opacus_functorch_modules(dp_model) -> List[str]:
    """Modules whose per-sample gradients Opacus computes with functorch (vmap of the module over
    the batch) because it has no grad sampler for their type; a trainable parameter owned by the
    root module (a timm ViT's ``cls_token``) puts the whole model there, and Opacus then hooks none
    of its layers."""
    inner = dp_model._module
    handled = {id(m) for m in dp_model.iterate_submodules(inner)}
    names = [name or f"{type(inner).__name__} (the whole model)"
             for name, m in inner.named_modules()
             if id(m) in handled and type(m) not in dp_model.GRAD_SAMPLERS]
    return names[:4] + ([f"… ({len(names)} modules)"] if len(names) > 4 else [])


SETUPS: Dict[str, Callable] = {
    "nondp": setup_nondp,
    **{mode: setup_ours(mode) for mode in OUR_MODES},
    "opacus_hooks": setup_opacus("hooks"),
    "opacus_ghost": setup_opacus("ghost"),
    "dropin_hooks": setup_opacus("hooks", dropin=True),
    "dropin_ghost": setup_opacus("ghost", dropin=True),
}
# the *_frozen methods: the same setup, fewer parameters
SETUPS.update({m: SETUPS[m[:-len(FROZEN)]] for m in METHODS if m.endswith(FROZEN)})


def build_runner(args, method: str, notes: dict) -> Runner:
    """``method`` ready to train on ``--batch-size``: its model, the batch and its setup. ``notes``
    receives the model's notes as soon as the model is built, so that they survive a setup that
    then fails (e.g. a layer Opacus does not support) and the error row still says what was
    traced."""
    model, found = build_model(args, method)
    notes.update(found)
    x, y = make_batch(args)
    return SETUPS[method](model, x, y, args)
