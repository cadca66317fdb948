"""The results as tables: the main table (time and memory, ratios to non-private training), our
methods against Opacus' on the same parameters, the lines saying whether the targets are met, and
rows formatted as aligned text or markdown."""
from __future__ import annotations

from typing import Dict, List, Optional

from .config import (
    FROZEN,
    MAX_BATCH_TARGET_RATIO,
    MEMORY_TARGET_RATIO,
    OPACUS,
    OURS,
    SKIPPED,
    TIME_TARGET_RATIO,
)


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "—"


def results_table(results: Dict[str, dict], cuda: bool = False) -> List[List[str]]:
    """Rows of the main table: time and memory, with ratios to non-private training.

    On CUDA a column gives the absolute peak (``max_memory_allocated``, model included) too; on CPU
    the absolute RSS would mostly be the Python runtime and libraries, so only increases are shown.
    """
    ref = results.get("nondp", {})
    batch = any("max_batch" in r for r in results.values())
    rows = [["method", "trainable", "s/step (median)", "min–max", "time × non-DP",
             "peak mem Δ (MiB)", "mem × non-DP", "1st-step peak Δ", "held after"]
            + (["peak total (MiB)", "peak reserved (MiB)"] if cuda else [])
            + (["max batch", "max batch × non-DP"] if batch else []) + ["notes"]]
    for m, r in results.items():
        trainable = f"{r['trainable']:,}" if "trainable" in r else "—"
        if "error" in r:
            rows.append([m, trainable] + ["—"] * (len(rows[0]) - 3) + [r["error"]])
            continue
        mb = r.get("max_batch")
        time_x = (f"{r['time_ratio']:.2f}×" if "time_ratio" in r
                  else ratio(r["median_s"], ref.get("median_s")))
        rows.append([m, trainable, f"{r['median_s']:.3f}",
                     f"{min(r['times']):.3f}–{max(r['times']):.3f}", time_x,
                     f"{r['peak_delta_mib']:.0f}",
                     ratio(r["peak_delta_mib"], ref.get("peak_delta_mib")),
                     f"{r['first_step_peak_delta_mib']:.0f}", f"{r['held_mib']:.0f}"]
                    + ([f"{r['peak_total_mib']:.0f}",
                        f"{r['peak_reserved_mib']:.0f}" if "peak_reserved_mib" in r else "—"]
                       if cuda else [])
                    + ([str(mb) if mb is not None else r.get("max_batch_error", "—"),
                        ratio(mb, ref.get("max_batch"))] if batch else [])
                    + [r.get("note", "")])
    return rows


def counterpart(ours: str, opacus: str) -> str:
    """The Opacus method training the same parameters as ``ours``: ``opacus_hooks_frozen`` for
    ``mixed_frozen``."""
    return opacus + FROZEN if ours.endswith(FROZEN) else opacus


def versus_opacus_table(results: Dict[str, dict]) -> List[List[str]]:
    """Rows comparing each of our modes with each Opacus mode on the same trainable parameters
    (``*_frozen`` with ``*_frozen``); ratios < 1 favour private_engine, "—" where either failed."""
    ours = [m for m in OURS if "median_s" in results.get(m, {})]
    if not ours or not any("median_s" in results.get(counterpart(m, o), {})
                           for m in ours for o in OPACUS):
        return []
    rows = [["ours"] + [f"time / {o}" for o in OPACUS] + [f"mem / {o}" for o in OPACUS]]
    for m in ours:
        r, theirs = results[m], [results.get(counterpart(m, o), {}) for o in OPACUS]
        rows.append([m] + [ratio(r["median_s"], t.get("median_s")) for t in theirs]
                    + [ratio(r["peak_delta_mib"], t.get("peak_delta_mib")) for t in theirs])
    return rows


def time_vs_nondp(results: Dict[str, dict], m: str) -> float:
    """Method ``m``'s time × non-DP: the median per-round ratio when there is one, else the ratio
    of the medians."""
    r = results[m]
    return r.get("time_ratio", r["median_s"] / results["nondp"]["median_s"])


def target_lines(args, results: Dict[str, dict]) -> List[str]:
    """The benchmark's speed and memory targets, met or not for each of our methods that ran (a
    failed one says why).

    CPU: seconds per step ≤ 1.15× non-DP (the target is set for ViT-Tiny at batch 16; other
    models are reported against the same bound). CUDA: the same time bound, peak memory Δ ≤ 1.10×
    non-DP's (the 'mem × non-DP' column) and, with ``--max-batch``, a maximum batch ≥ 0.9×
    non-DP's.
    """
    ref = results.get("nondp", {})
    if "median_s" not in ref:
        return []
    ran = [m for m in OURS if "median_s" in results.get(m, {})]
    failed = [f"{m}: failed ({results[m]['error'][:120]})" for m in OURS
              if "error" in results.get(m, {}) and not results[m]["error"].startswith(SKIPPED)]

    def line(what: str, bound: float, values: Dict[str, float], at_least: bool = False,
             first: bool = False) -> str:
        def met(x: float) -> bool:
            return x >= bound if at_least else x <= bound

        parts = [f"{m}: {x:.2f}× ({'met' if met(x) else 'not met'})" for m, x in values.items()]
        parts += failed if first else []  # failures once, in the first line
        return (f"{what} {'≥' if at_least else '≤'} {bound}× non-DP — "
                + "; ".join(parts or ["none ran"]) + ".")

    times = {m: time_vs_nondp(results, m) for m in ran}
    if args.device == "cpu":
        if not (ran or failed):
            return []
        return [line("Target on CPU (set for vit_tiny_patch16_224 at batch 16): private_engine "
                     "time per step", TIME_TARGET_RATIO, times, first=True)]
    lines = [line("Target on CUDA: private_engine time per step", TIME_TARGET_RATIO, times,
                  first=True)]
    if ref.get("peak_delta_mib"):
        mems = {m: results[m]["peak_delta_mib"] / ref["peak_delta_mib"] for m in ran}
        lines.append(line("Target on CUDA: private_engine peak memory Δ", MEMORY_TARGET_RATIO,
                          mems))
    if ref.get("max_batch"):
        batches = {m: results[m]["max_batch"] / ref["max_batch"] for m in ran
                   if results[m].get("max_batch") is not None}
        lines.append(line("Target on CUDA: private_engine max batch", MAX_BATCH_TARGET_RATIO,
                          batches, at_least=True))
    elif args.device == "cuda":
        lines.append(f"Target on CUDA: private_engine max batch ≥ {MAX_BATCH_TARGET_RATIO}× "
                     "non-DP — not measured (run with --max-batch).")
    return lines


def format_text(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(" --- " for _ in rows[0]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)
