"""The figure: for every model of the run, one panel of grouped bars per method (time, peak
memory and, when measured, max batch, each × non-DP), with the targets as dashed lines."""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Dict

from .config import MAX_BATCH_TARGET_RATIO, MEMORY_TARGET_RATIO, METHODS, SKIPPED, TIME_TARGET_RATIO
from .tables import time_vs_nondp


def write_plot(args, everything: Dict[str, Dict[str, dict]]) -> None:
    """``--plot`` (or its default next to ``--markdown``): one figure for every model run so
    far."""
    amp = f", {args.amp} autocast" if args.amp != "none" else ""
    subtitle = (f"{args.device}, batch {args.batch_size}, {args.dtype}{amp}, "
                f"{datetime.date.today().isoformat()}")
    plot_results(everything, Path(args.plot), subtitle, cuda=args.device == "cuda")
    print(f"wrote {args.plot}")


def plot_results(everything: Dict[str, Dict[str, dict]], path: Path, subtitle: str = "",
                 cuda: bool = False) -> None:
    """Write a png with one panel per model: for every method, grouped bars of time × non-DP and
    peak memory × non-DP (and max batch × non-DP when measured), a dashed line at 1 and dashed
    lines at the targets. A method that failed gets a 'failed' mark instead of bars (the tables
    say why); a model whose non-DP run failed has no ratios and is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, res in everything.items() if "median_s" in res.get("nondp", {})]
    if not models:
        print(f"no plot: no model has a non-DP result to compare with; {path} not written")
        return
    methods = [m for m in METHODS if any(m in everything[model] for model in models)]
    fig, axes = plt.subplots(len(models), 1,
                             figsize=(max(8.0, 0.9 * len(methods) + 2), 3.2 * len(models) + 0.8),
                             squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        res = everything[model]
        ref = res["nondp"]
        series = [("time × non-DP", "#1f77b4", TIME_TARGET_RATIO,
                   lambda m: time_vs_nondp(res, m)),
                  ("peak memory × non-DP", "#ff7f0e", MEMORY_TARGET_RATIO if cuda else None,
                   lambda m: res[m]["peak_delta_mib"] / ref["peak_delta_mib"]
                   if ref.get("peak_delta_mib") else None)]
        if ref.get("max_batch"):
            series.append(("max batch × non-DP", "#2ca02c", MAX_BATCH_TARGET_RATIO,
                           lambda m: res[m]["max_batch"] / ref["max_batch"]
                           if res[m].get("max_batch") else None))
        width = 0.8 / len(series)
        top = 1.0
        for k, (label, color, target, value) in enumerate(series):
            xs, ys = [], []
            for i, m in enumerate(methods):
                v = value(m) if "median_s" in res.get(m, {}) else None
                if v is not None:
                    xs.append(i + (k - (len(series) - 1) / 2) * width)
                    ys.append(v)
            bars = ax.bar(xs, ys, width, color=color, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
            top = max([top] + ys)
            if target is not None:
                ax.axhline(target, color=color, lw=1, ls="--",
                           label=f"target {target}× ({label.split(' ×')[0]})")
        ax.axhline(1.0, color="black", lw=0.8, ls="--", label="non-DP (1×)")
        for i, m in enumerate(methods):
            if m not in res:
                ax.text(i, 0.05 * top, "not run", ha="center", rotation=90, fontsize=7,
                        color="grey")
            elif "median_s" not in res[m]:
                skipped = res[m].get("error", "").startswith(SKIPPED)
                ax.text(i, 0.05 * top, "skipped" if skipped else "failed", ha="center",
                        rotation=90, fontsize=7, color="grey" if skipped else "red")
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("× non-DP")
        ax.set_title(model, fontsize=10)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"private_engine and Opacus relative to non-private training; {subtitle}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
