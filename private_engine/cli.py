"""Command line: ``private-engine plan | epsilon | noise | probe | audit``."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .clipping.plan import CLIPPING_MODES, DEFAULT_CLIPPING_MODE


def _ints(text: str) -> List[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 3,224,224; got {text!r}") from None


def cmd_plan(args) -> int:
    """Print the per-layer ghost/instantiate decision for a named model: eq. 4.1 of Bu, Mao & Xu
    (2022), "Scalable and Efficient Training of Large Convolutional Neural Networks with
    Differential Privacy" (mixed ghost clipping), as applied by ``--mode``."""
    import torch

    from .demo.models import create_model
    from .clipping.plan import format_plan, layer_plan
    from .guards.model_check import (batchnorm_modules, fallback_modules, fix_batchnorm,
                                     traced_parameters)

    model = create_model(args.model, pretrained=False)
    if batchnorm_modules(model):
        model = fix_batchnorm(model)
        print("note: BatchNorm replaced by GroupNorm (private_engine.fix_batchnorm) for the plan")
    model.train()
    x = torch.randn(args.batch_size, *args.input_size)
    plan = layer_plan(model, x, mode=args.mode)
    print(format_plan(plan, title=f"{args.model} at input {tuple(args.input_size)}, "
                                  f"mode={args.mode}"))
    traced = traced_parameters(model)
    if traced:
        print("\nclipped by the parameter-entry tracer (instantiated, see docs/engine.md): "
              f"{', '.join(traced)}")
    slow = fallback_modules(model)
    if slow:
        print(f"clipped by the torch.func fallback (exact, slower): {', '.join(slow)}")
    return 0


def _sampling(args):
    """``(q, steps, δ)`` from the training-length options (δ defaults to 1/(2n), as the engine)."""
    from .accounting import steps_for

    q = args.batch_size / args.sample_size
    delta = args.delta if args.delta is not None else 1.0 / (2 * args.sample_size)
    return q, steps_for(args.epochs, args.steps, q), delta


def cmd_epsilon(args) -> int:
    """ε spent by DP-SGD with noise σ, batch B, n examples, after the given epochs or steps."""
    from .accounting import epsilon_for

    q, steps, delta = _sampling(args)
    eps = epsilon_for(args.noise_multiplier, q, steps, delta, args.accountant)
    print(f"ε = {eps:.4f} at δ = {delta:.3g} ({args.accountant}; σ = {args.noise_multiplier}, "
          f"q = {q:.5g}, {steps} steps)")
    return 0


def cmd_noise(args) -> int:
    """The noise multiplier σ that spends ``--epsilon`` over the given training length."""
    from .accounting import calibrate_noise_multiplier

    q, steps, delta = _sampling(args)
    sigma = calibrate_noise_multiplier(args.epsilon, delta, q, steps, args.accountant)
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
    parser = argparse.ArgumentParser(prog="private-engine",
                                     description="Differentially private training tools.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan",
                       help="per-layer ghost/instantiate decision for a timm/torchvision model")
    p.add_argument("--model", required=True,
                   help="timm or torchvision model name, e.g. vit_tiny_patch16_224")
    p.add_argument("--input-size", type=_ints, default=[3, 224, 224],
                   help="C,H,W of one sample (default 3,224,224)")
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

    from .heads.probe import add_probe_arguments, run_probe

    p = sub.add_parser("probe", help="DP linear probes (DP-LS, DP-Newton, DP-FC, DP-Adam, "
                                     "DP mean) over a list of ε")
    add_probe_arguments(p)
    p.set_defaults(func=run_probe)

    from .audit.command import add_audit_arguments, run_audit_command

    p = sub.add_parser("audit", help="empirical privacy audit: an ε lower bound from one "
                                     "training run with gradient canaries (docs/audit.md)")
    add_audit_arguments(p)
    p.set_defaults(func=run_audit_command)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
