"""The ``private-engine audit`` command: options, one audit, a one-line summary (and, with more
than one path audited, a line per path).

Exit status 0 when the outcome is the expected one — "consistent" for the engine as it is, a
VIOLATION for a positive control (``--control noise_scaled`` or ``clip_scaled``) — and 1
otherwise, so that the command can gate a CI job.
"""
from __future__ import annotations

import argparse

from ..audit.config import CONTROLS, DIRECTIONS, DOORS, PATHS, SCORES, AuditConfig
from ..clipping.plan import CLIPPING_MODES

__all__ = ["add_audit_arguments", "config_from_args", "run_audit_command"]


def _paths(text: str):
    """``all`` or comma-separated path names."""
    if text == "all":
        return text
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PATHS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown path(s) {unknown}; paths: {','.join(PATHS)}")
    return names


def add_audit_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the audit's options (the fields of :class:`AuditConfig`) to ``p``."""
    d = AuditConfig()
    p.add_argument("--canaries", type=int, default=d.canaries,
                   help=f"m, each included with probability 1/2 (default {d.canaries})")
    p.add_argument("--paths", type=_paths, default=d.paths,
                   help=f"clipping paths to audit, comma-separated, or 'all' (default): "
                        f"{','.join(PATHS)}")
    p.add_argument("--door", default=d.door, choices=list(DOORS),
                   help="native PrivacyEngine (step(loss=…)) or the Opacus drop-in "
                        "(make_private, loss.backward())")
    p.add_argument("--clipping-mode", default=d.clipping_mode, choices=list(CLIPPING_MODES),
                   help=f"the engine's clipping mode (native door; default {d.clipping_mode})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"DP-SGD steps ({d.steps})")
    p.add_argument("--batch-size", type=int, default=None,
                   help="expected logical batch (default: half the rows, q ≈ 1/2)")
    p.add_argument("--data-size", type=int, default=d.data_size,
                   help=f"non-canary examples ({d.data_size})")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epsilon", type=float, default=None,
                   help=f"claimed ε; σ calibrated to it (default {AuditConfig.DEFAULT_EPSILON})")
    g.add_argument("--noise-multiplier", type=float, default=None, help="claimed σ instead")
    p.add_argument("--delta", type=float, default=d.delta, help=f"δ ({d.delta:g})")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="R")
    p.add_argument("--accountant", default=d.accountant, choices=["rdp", "prv", "gdp"])
    p.add_argument("--confidence", type=float, default=d.confidence,
                   help=f"1 − β of the lower bound ({d.confidence})")
    p.add_argument("--control", default=d.control, choices=list(CONTROLS),
                   help="positive control: noise_scaled runs σ/factor, clip_scaled clips at "
                        "R·factor with σ/factor, both while claiming the ε of σ")
    p.add_argument("--control-factor", type=float, default=d.control_factor,
                   help=f"how much less private the control runs ({d.control_factor:g})")
    p.add_argument("--score", default=d.score, choices=list(SCORES))
    p.add_argument("--directions", default=d.directions, choices=list(DIRECTIONS))
    p.add_argument("--seed", type=int, default=d.seed,
                   help="data, model, canaries (never the engine's noise or sampling)")
    p.add_argument("--plot", default=None, help="save the canary score histograms here (png)")
    p.add_argument("--progress", action="store_true", help="a progress bar over the steps")
    return p


def config_from_args(args: argparse.Namespace) -> AuditConfig:
    """The :class:`AuditConfig` of parsed options."""
    return AuditConfig(canaries=args.canaries, paths=args.paths, door=args.door,
                       clipping_mode=args.clipping_mode, steps=args.steps,
                       batch_size=args.batch_size,
                       data_size=args.data_size, epsilon=args.epsilon,
                       noise_multiplier=args.noise_multiplier, delta=args.delta,
                       max_grad_norm=args.max_grad_norm, accountant=args.accountant,
                       confidence=args.confidence, control=args.control,
                       control_factor=args.control_factor, score=args.score,
                       directions=args.directions, seed=args.seed, progress=args.progress)


def run_audit_command(args: argparse.Namespace) -> int:
    """Run one audit, print its summary line (and save the plot); the exit status."""
    from ..audit.report import format_paths, plot_scores
    from ..audit.run import run_audit

    result = run_audit(config_from_args(args))
    print(result.summary())
    if result.path_results:
        print(format_paths(result))
    if args.plot:
        plot_scores(result, args.plot)
        print(f"plot: {args.plot}")
    expected = result.violation if result.control != "none" else not result.violation
    return 0 if expected else 1
