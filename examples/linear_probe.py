#!/usr/bin/env python
"""DP linear probe on embedded data: every last-layer DP solver over a list of ε.

Extracts penultimate features of a timm backbone built offline (random weights unless
``--pretrained``) on scikit-learn's embedded digits (no download), caches them on disk, fits
DP-LS, DP-Newton, DP-FC, DP-Adam and the DP class-mean classifier at each ε, prints a table of
test accuracies and saves a plot of accuracy vs ε. Same options as ``private-engine probe``, plus
``--output-dir``: the plot and the feature cache go there (default ``outputs/linear_probe`` in the
checkout, ignored by git) unless ``--plot`` / ``--cache-dir`` name other places.

    python examples/linear_probe.py                      # ViT-tiny features (~1 min on 2 CPU cores)
    python examples/linear_probe.py --features raw       # the 64 raw pixels
    python examples/linear_probe.py --dataset synthetic  # 50-class synthetic clusters
"""
import argparse
from pathlib import Path

from private_engine.commands.probe import add_probe_arguments, run_probe

DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parents[1] / "outputs" / "linear_probe"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                        help="folder for the plot and the feature cache (default: "
                             "outputs/linear_probe in the checkout)")
    add_probe_arguments(parser)
    parser.set_defaults(plot=None, cache_dir=None)
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    if args.plot is None:
        args.plot = str(out / "linear_probe.png")
    if args.cache_dir is None:
        args.cache_dir = str(out / "features")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    return run_probe(args)


if __name__ == "__main__":
    raise SystemExit(main())
