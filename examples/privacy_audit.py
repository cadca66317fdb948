#!/usr/bin/env python
"""Empirical privacy audit of the engine over a sweep of claimed ε, with a positive control.

For each claimed ε, trains once with the real engine (σ calibrated to ε) and once with a
deliberately broken run (the positive control: the engine at σ/100 while ε of σ is claimed), each
with m gradient canaries included with probability 1/2, and turns the canaries' guesses into an
ε lower bound by the one-run method of Steinke, Nasr & Jagielski (2023), "Privacy Auditing with
One (1) Training Run". Prints a table and plots the empirical lower bound against the claimed ε
(docs/audit.md): the engine must stay below the diagonal, the control above it. The plot goes to
``--plot``, by default ``privacy_audit.png`` in ``--output-dir`` (``outputs/privacy_audit`` in the
checkout, ignored by git).

    python examples/privacy_audit.py                 # 50,000 canaries, ε = 1, 2, 4, 8 (~3 min)
    python examples/privacy_audit.py --canaries 1000 --delta 1e-5 --epsilons 1,2,4
    python examples/privacy_audit.py --paths all --canaries 9000 --epsilons 1,2 --door opacus

One run certifies at most ≈ log(r / log(J/β)) with r guesses (the "ceiling"), so a control at
ε = 8 needs tens of thousands of canaries, and δ ≪ 1/m (the δ term of the bound grows as 2mδ).
The sweep puts its canaries on the bias-free Linear canary head (``--paths linear``, the default
here): the heads of the other clipping paths give each canary an output unit or a feature of its
own, so their width, and the memory of a run, grow with the canaries per path (9 paths at 50,000
canaries would need tens of GB). ``--paths all`` audits every path with fewer canaries, and the
table then lists each path's own bound.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from private_engine.audit import AuditConfig, run_audit
from private_engine.audit.config import CONTROLS
from private_engine.audit.report import format_paths, format_table, plot_sweep

ROOT = Path(__file__).resolve().parents[1]


def _floats(text: str):
    return [float(v) for v in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilons", type=_floats, default=[1.0, 2.0, 4.0, 8.0],
                   help="claimed ε values, comma-separated (default 1,2,4,8)")
    p.add_argument("--canaries", type=int, default=50_000)
    p.add_argument("--data-size", type=int, default=2_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--delta", type=float, default=1e-7)
    p.add_argument("--control", default="noise_scaled",
                   choices=[c for c in CONTROLS if c != "none"])
    p.add_argument("--control-factor", type=float, default=100.0)
    p.add_argument("--paths", default="linear",
                   help="clipping paths, comma-separated, or 'all' (default: linear)")
    p.add_argument("--door", default="native", choices=["native", "opacus"])
    p.add_argument("--clipping-mode", default="bk_mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=str(ROOT / "outputs" / "privacy_audit"),
                   help="folder of the plot (default: outputs/privacy_audit in the checkout)")
    p.add_argument("--plot", default=None,
                   help="the plot's path (default: OUTPUT_DIR/privacy_audit.png)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.plot is None:
        args.plot = str(Path(args.output_dir) / "privacy_audit.png")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    paths = args.paths if args.paths == "all" else tuple(args.paths.split(","))
    base = AuditConfig(canaries=args.canaries, data_size=args.data_size, steps=args.steps,
                       delta=args.delta, seed=args.seed, control_factor=args.control_factor,
                       paths=paths, door=args.door, clipping_mode=args.clipping_mode)
    runs = [(eps, control) for eps in args.epsilons for control in ("none", args.control)]
    results = []
    for eps, control in tqdm(runs, desc="audits"):
        results.append(run_audit(base, epsilon=eps, control=control, progress=True))
    print(format_table(results))
    for r in results:
        if r.path_results:
            control = "" if r.control == "none" else f" ({r.control}×{r.control_factor:g})"
            print(f"\nclaimed ε={r.epsilon_claimed:.3f}{control}, each path's canaries alone:")
            print(format_paths(r))
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot_sweep(results, args.plot,
               title=f"One-run audit: {args.canaries} canaries, {args.steps} steps, "
                     f"δ={args.delta:g}")
    print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in results], indent=1))
    wrong = [r for r in results if r.violation != (r.control != "none")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
