"""Tables and plots of audit results: a sweep over claimed ε, and one run's canary scores."""
from __future__ import annotations

from typing import Sequence

from .config import AuditResult

__all__ = ["format_table", "format_paths", "plot_sweep", "plot_scores"]


def format_table(results: Sequence[AuditResult]) -> str:
    """A fixed-width table, one row per result: claimed ε, ε_lower, guesses, verdict."""
    head = (f"{'control':<18} {'claimed ε':>9} {'σ':>7} {'ε_lower':>8} {'ceiling':>7} "
            f"{'correct/guesses':>15} {'seconds':>7}  verdict")
    lines = [head, "-" * len(head)]
    for r in results:
        control = r.control if r.control == "none" else f"{r.control}×{r.control_factor:g}"
        lines.append(f"{control:<18} {r.epsilon_claimed:>9.3f} {r.noise_multiplier:>7.4f} "
                     f"{r.epsilon_lower:>8.3f} {r.epsilon_ceiling:>7.2f} "
                     f"{f'{r.correct}/{r.guesses}':>15} {r.seconds:>7.1f}  {r.verdict}")
    return "\n".join(lines)


def format_paths(result: AuditResult) -> str:
    """One line per audited path: its canaries judged alone — ε_lower, right guesses, the bound if
    every guess were right (``reach``: what a broken path shows) — and whether they refute the
    claimed ε."""
    head = (f"  {'path':<12} {'canaries':>8} {'ε_lower':>8} {'reach':>7} "
            f"{'correct/guesses':>15}  verdict")
    lines = [head]
    for p in result.path_results:
        verdict = "VIOLATION" if p.epsilon_lower > result.epsilon_claimed else "consistent"
        lines.append(f"  {p.path:<12} {p.canaries:>8} {p.epsilon_lower:>8.3f} "
                     f"{p.epsilon_reach:>7.2f} {f'{p.correct}/{p.guesses}':>15}  {verdict}")
    return "\n".join(lines)


def plot_sweep(results: Sequence[AuditResult], path: str, title: str = "") -> None:
    """Empirical ε_lower against claimed ε, one line per control, with the diagonal (above it:
    a violation) and the ceiling of the guesses (the most one run can certify)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    claimed = sorted({r.epsilon_claimed for r in results})
    top = max([r.epsilon_ceiling for r in results] + claimed)
    ax.plot([0, top], [0, top], color="grey", ls="--", lw=1,
            label="ε_lower = claimed ε (above: violation)")
    ceilings = sorted({(r.epsilon_claimed, r.epsilon_ceiling) for r in results})
    ax.plot([c for c, _ in ceilings], [e for _, e in ceilings], color="grey", ls=":", lw=1,
            label="ceiling (every guess right)")
    styles = {"none": ("tab:blue", "o"), "noise_scaled": ("tab:red", "s"),
              "clip_scaled": ("tab:orange", "^")}
    for control in dict.fromkeys(r.control for r in results):
        rows = sorted((r for r in results if r.control == control),
                      key=lambda r: r.epsilon_claimed)
        color, marker = styles.get(control, ("black", "x"))
        label = ("engine (real clipping and noise)" if control == "none"
                 else f"positive control: {control} ×{rows[0].control_factor:g}")
        ax.plot([r.epsilon_claimed for r in rows], [r.epsilon_lower for r in rows],
                color=color, marker=marker, label=label)
    ax.set_xlabel("claimed ε (accountant)")
    ax.set_ylabel(f"empirical ε lower bound ({results[0].confidence:.0%} confidence)")
    ax.set_title(title or "One-run privacy audit (Steinke, Nasr & Jagielski 2023)")
    ax.set_xlim(0, top * 1.05)
    ax.set_ylim(0, top * 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scores(result: AuditResult, path: str) -> None:
    """Histograms of the canaries' scores, included against excluded, with the thresholds of the
    best guessing rule (the k₊ highest are guessed included, the k₋ lowest excluded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scores = np.asarray(result.scores)
    inc = np.asarray(result.inclusion, dtype=bool)
    order = np.sort(scores)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    bins = np.linspace(order[0], order[-1], 60) if order[-1] > order[0] else 10
    ax.hist(scores[inc], bins=bins, alpha=0.6, label=f"included ({inc.sum()})")
    ax.hist(scores[~inc], bins=bins, alpha=0.6, label=f"excluded ({(~inc).sum()})")
    ax.axvline(order[-result.k_plus], color="tab:green", ls="--", lw=1,
               label=f"top {result.k_plus}: guessed included")
    ax.axvline(order[result.k_minus - 1], color="tab:red", ls="--", lw=1,
               label=f"bottom {result.k_minus}: guessed excluded")
    ax.set_xlabel(f"canary score ({result.score})")
    ax.set_ylabel("canaries")
    ax.set_title(f"ε_lower={result.epsilon_lower:.2f}, claimed ε={result.epsilon_claimed:.2f} "
                 f"({result.correct}/{result.guesses} right)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
