"""Command line: ``private-engine plan | epsilon | noise | probe | audit``.

Bad input is answered in one line on stderr naming what to change, with exit status 2 (the
convention of ``argparse``'s ``parser.error``), never with a traceback.
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings
from typing import List, NoReturn, Optional

from .clipping.plan import CLIPPING_MODES, DEFAULT_CLIPPING_MODE


class UsageError(Exception):
    """Input the command cannot use; its message says what to change."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (``prog: error: …``), exit 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` (with a pointer to ``--help``) and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _ints(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 3,224,224; got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"every size must be a positive integer, like 3,224,224; got {text!r}")
    return values


def _build_plan_model(args):
    """``(model, example batch, description of one sample)`` for ``--model``: a timm or
    torchvision name, or a Hugging Face model whose config.json is on disk (built without
    weights, nothing downloaded)."""
    import torch

    from .demo.hf_models import hf_example_input, hf_model_from_config, local_hf_config
    from .demo.models import create_model

    try:
        config = local_hf_config(args.model)
        model = (hf_model_from_config(config) if config is not None
                 else create_model(args.model, pretrained=False))
    except ValueError as err:
        raise UsageError(
            f"{str(err).rstrip('.')}; --model takes a timm or torchvision name (e.g. resnet18), a "
            "folder with a Hugging Face config.json, or a hub id already in the local Hugging "
            "Face cache (nothing is downloaded)") from None
    if config is not None:
        try:
            x, what = hf_example_input(config, args.batch_size, args.input_size)
        except ValueError as err:
            raise UsageError(str(err)) from None
        return model, x, what
    size = args.input_size or [3, 224, 224]
    return model, torch.randn(args.batch_size, *size), f"input {tuple(size)}"


def cmd_plan(args) -> int:
    """Print the per-layer ghost/instantiate decision for a named model: eq. 4.1 of Bu, Mao & Xu
    (2022), "Scalable and Efficient Training of Large Convolutional Neural Networks with
    Differential Privacy" (mixed ghost clipping), as applied by ``--mode``."""
    from .clipping.plan import format_plan, layer_plan
    from .guards.model_check import (
        batchnorm_modules,
        fallback_modules,
        fix_batchnorm,
        traced_parameters,
    )

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    model, x, what = _build_plan_model(args)
    if batchnorm_modules(model):
        model = fix_batchnorm(model)
        print("note: BatchNorm replaced by GroupNorm (private_engine.fix_batchnorm) for the plan")
    model.train()
    try:
        plan = layer_plan(model, x, mode=args.mode)
    except (RuntimeError, ValueError, IndexError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(
            f"{args.model} does not run on a batch of shape {tuple(x.shape)} ({first}); give "
            "--input-size as the shape of one sample the model takes (C,H,W for images, T for "
            "token ids)") from None
    print(format_plan(plan, title=f"{args.model} at {what}, mode={args.mode}"))
    traced = traced_parameters(model)
    if traced:
        print("\nclipped by the parameter-entry tracer (instantiated, see docs/engine.md): "
              f"{', '.join(traced)}")
    slow = fallback_modules(model)
    if slow:
        print(f"clipped by the torch.func fallback (exact, slower): {', '.join(slow)}")
    return 0


def _check_training_length(args) -> None:
    """Refuse, naming the option, a training length no accountant can take."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.sample_size < 1:
        raise UsageError(f"--sample-size must be at least 1, got {args.sample_size}")
    if args.batch_size > args.sample_size:
        raise UsageError(
            f"--batch-size {args.batch_size} is larger than --sample-size {args.sample_size}: "
            "the sampling rate q = B/n must be at most 1; give a batch size of at most the "
            "number of training examples")
    if args.epochs is not None and not (args.epochs > 0 and math.isfinite(args.epochs)):
        raise UsageError(f"--epochs must be a positive finite number, got {args.epochs}")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.delta is not None and not 0 < args.delta < 1:
        raise UsageError(f"--delta must be in (0, 1), e.g. 1e-5, got {args.delta}")


def _sampling(args):
    """``(q, steps, δ)`` from the training-length options (δ defaults to 1/(2n), as the engine)."""
    from .accounting import steps_for

    _check_training_length(args)
    q = args.batch_size / args.sample_size
    delta = args.delta if args.delta is not None else 1.0 / (2 * args.sample_size)
    if args.steps is None and args.epochs / q < 1:
        raise UsageError(
            f"--epochs {args.epochs} at q = B/n = {q:.4g} is {args.epochs / q:.3g} steps, fewer "
            "than one: give more --epochs, or --steps")
    return q, steps_for(args.epochs, args.steps, q), delta


def cmd_epsilon(args) -> int:
    """ε spent by DP-SGD with noise σ, batch B, n examples, after the given epochs or steps."""
    from .accounting import epsilon_for

    if not (args.noise_multiplier > 0 and math.isfinite(args.noise_multiplier)):
        raise UsageError(f"--noise-multiplier must be a positive finite σ, e.g. 1.0, got "
                         f"{args.noise_multiplier} (σ = 0 adds no noise: ε is infinite)")
    q, steps, delta = _sampling(args)
    eps = epsilon_for(args.noise_multiplier, q, steps, delta, args.accountant)
    print(f"ε = {eps:.4f} at δ = {delta:.3g} ({args.accountant}; σ = {args.noise_multiplier}, "
          f"q = {q:.5g}, {steps} steps)")
    return 0


def cmd_noise(args) -> int:
    """The noise multiplier σ that spends ``--epsilon`` over the given training length."""
    from .accounting import calibrate_noise_multiplier

    if not (args.epsilon > 0 and math.isfinite(args.epsilon)):
        raise UsageError(f"--epsilon must be a positive finite number, e.g. 3, got {args.epsilon}")
    q, steps, delta = _sampling(args)
    try:
        with warnings.catch_warnings():  # the search's probes at extreme σ warn about orders
            warnings.filterwarnings("ignore", message="Optimal order")
            sigma = calibrate_noise_multiplier(args.epsilon, delta, q, steps, args.accountant)
    except ValueError as err:
        if "too low" not in str(err):
            raise
        raise UsageError(
            f"no noise multiplier reaches ε = {args.epsilon} at δ = {delta:.3g} over {steps} "
            f"steps at q = {q:.4g} ({args.accountant}): raise --epsilon or --delta, or train "
            "for fewer --epochs/--steps") from None
    print(f"σ = {sigma:.5f} for ε = {args.epsilon} at δ = {delta:.3g} ({args.accountant}; "
          f"q = {q:.5g}, {steps} steps)")
    return 0


def _training_length(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, required=True, help="expected logical batch size B")
    p.add_argument("--sample-size", type=int, required=True, help="number of training examples n")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--epochs", type=float)
    g.add_argument("--steps", type=int)
    p.add_argument("--delta", type=float, default=None, help="default 1/(2n)")
    p.add_argument("--accountant", default="rdp", choices=["rdp", "prv", "gdp", "pld"])


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="private-engine",
                           description="Differentially private training tools.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="per-layer ghost/instantiate decision for a timm, "
                                    "torchvision or Hugging Face model")
    p.add_argument("--model", required=True,
                   help="timm or torchvision model name (e.g. vit_tiny_patch16_224), a folder "
                        "with a Hugging Face config.json (weights not needed), or a hub id in "
                        "the local Hugging Face cache; nothing is downloaded")
    p.add_argument("--input-size", type=_ints, default=None,
                   help="one sample: C,H,W for images (default 3,224,224, or the config's "
                        "image size), T for token ids (default min(128, max positions))")
    p.add_argument("--mode", default=DEFAULT_CLIPPING_MODE, choices=list(CLIPPING_MODES))
    p.add_argument("--batch-size", type=int, default=1, help="batch used for the shape pass")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("epsilon",
                       help="ε spent by DP-SGD for a noise multiplier and training length")
    p.add_argument("--noise-multiplier", type=float, required=True)
    _training_length(p)
    p.set_defaults(func=cmd_epsilon)

    p = sub.add_parser("noise", help="noise multiplier σ calibrated to a target ε")
    p.add_argument("--epsilon", type=float, required=True)
    _training_length(p)
    p.set_defaults(func=cmd_noise)

    from .commands.probe import add_probe_arguments, run_probe

    p = sub.add_parser("probe", help="DP linear probes (DP-LS, DP-Newton, DP-FC, DP-Adam, "
                                     "DP mean) over a list of ε")
    add_probe_arguments(p)
    p.set_defaults(func=run_probe)

    from .commands.audit import add_audit_arguments, run_audit_command

    p = sub.add_parser("audit", help="empirical privacy audit: an ε lower bound from one "
                                     "training run with gradient canaries (docs/audit.md)")
    add_audit_arguments(p)
    p.set_defaults(func=run_audit_command)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; input it cannot use ends in one line on stderr and exit status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        prog = f"{parser.prog} {args.command}"
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
