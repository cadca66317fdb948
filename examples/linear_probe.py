#!/usr/bin/env python
"""DP linear probe on embedded data: every last-layer DP solver over a list of ε.

Extracts penultimate features of a timm backbone built offline (random weights unless
``--pretrained``) on scikit-learn's embedded digits (no download), caches them on disk, fits
DP-LS, DP-Newton, DP-FC, DP-Adam and the DP class-mean classifier at each ε, prints a table of
test accuracies and saves a plot of accuracy vs ε. Same options as ``private-engine probe``.

    python examples/linear_probe.py                      # ViT-tiny features (~1 min on 2 CPU cores)
    python examples/linear_probe.py --features raw       # the 64 raw pixels
    python examples/linear_probe.py --dataset synthetic  # 50-class synthetic clusters
"""
from private_engine.heads.probe import main

if __name__ == "__main__":
    raise SystemExit(main())
