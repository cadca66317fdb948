"""The text around the tables: the machine and software measured, the commit, the setup lines
(what was trained and how memory was measured), the section's title and key, and the markdown
section written into (or replaced in) ``--markdown``."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from .config import FROZEN, TEXT_MODEL, TEXT_VOCAB
from .tables import format_markdown, results_table, target_lines, versus_opacus_table

#: the repository measured (its git commit is reported)
REPO = Path(__file__).resolve().parents[2]


def machine_info(device: str, load: Optional[float] = None) -> Dict[str, str]:
    import opacus
    import timm
    import torch

    cpu = platform.processor() or "unknown CPU"
    mem = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            mem = f", {kib / 2 ** 20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    busy = f", 1-min load average {load:.1f} at start" if load is not None else ""
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores (torch threads: {torch.get_num_threads()})"
                   f"{mem}{busy}",
        "device": name,
        "software": f"Python {platform.python_version()}, torch {torch.__version__}, "
                    f"timm {timm.__version__}, opacus {opacus.__version__}",
    }


def engine_revision() -> str:
    """The git commit of the private_engine measured, flagged when its private_engine/ has
    uncommitted changes; the folder it was imported from when that is not this repository
    (``PE_ENGINE_DIR``), with ``PE_ENGINE_COMMIT`` as its label where it is no git checkout."""
    import private_engine

    home = Path(private_engine.__file__).resolve().parents[1]
    where = "" if home == REPO else f" (the package in {home})"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=home,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "private_engine"], cwd=home,
                               capture_output=True, text=True, check=True).stdout.rstrip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PE_ENGINE_COMMIT", "unknown (not a git checkout)") + where
    if where and os.environ.get("PE_ENGINE_COMMIT"):
        rev = os.environ["PE_ENGINE_COMMIT"]
    changed = [line[3:] for line in dirty.splitlines()]
    return rev + where + (f" (uncommitted changes: {', '.join(changed)})" if changed else "")


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a)
                                for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def setup_lines(args, results: Dict[str, dict]) -> List[str]:
    """What the methods trained, read back from the subprocesses (those that got as far as
    building the model)."""
    ok = next((r for r in results.values() if "trainable" in r), None)
    data = (f"fixed random token ids ({args.seq_len} per sample, vocabulary {TEXT_VOCAB}; "
            "--img-size ignored)" if args.model == TEXT_MODEL else "a fixed random batch")
    amp = {"none": "", "bf16": ", bfloat16 autocast",
           "fp16": ", float16 autocast + GradScaler"}[args.amp]
    if args.schedule == "one-process":
        schedule = ("every method timed in one process, interleaved (one step of each method "
                    "per round; 'time × non-DP' is the median of the per-round ratios; memory "
                    "from one subprocess per method).")
    else:
        schedule = (f"one subprocess per method, {args.schedule}"
                    + (" (one step of each method per round; 'time × non-DP' is the median of "
                       "the per-round ratios)." if args.schedule == "interleaved" else "."))
    lines = [f"SGD (lr {args.lr}), cross-entropy on {data}, {args.num_classes} classes, "
             f"σ = {args.noise_multiplier}, R = {args.max_grad_norm}, {args.dtype}{amp}; "
             f"{args.steps} timed steps after {args.warmup} warm-up, median; " + schedule]
    if ok is None:
        return lines
    frozen_set = next((r["frozen_set"] for r in results.values() if r.get("frozen_set")), [])
    lines.append("All parameters trainable"
                 + (f" except, in the *{FROZEN} methods, {', '.join(frozen_set)}"
                    if frozen_set else "") + " ('trainable' column).")
    if ok.get("traced"):
        lines.append(f"private_engine clips by its parameter-entry tracer: "
                     f"{', '.join(ok['traced'][:6])}"
                     + (f", … ({len(ok['traced'])} in all)" if len(ok["traced"]) > 6 else "")
                     + ".")
    if ok.get("fallback"):
        lines.append(f"private_engine clips by its torch.func fallback: "
                     f"{', '.join(ok['fallback'])}.")
    if ok.get("frozen_glob"):
        lines.append(f"Frozen by --freeze: {len(ok['frozen_glob'])} parameters.")
    for key in ("batchnorm", "inplace"):
        if ok.get(key):
            lines.append(ok[key][0].upper() + ok[key][1:] + ".")
    mem = ("torch.cuda.max_memory_allocated" if args.device == "cuda" else
           "peak RSS (VmHWM reset per method) in a second, 2-step run per method with glibc's "
           "mmap threshold fixed (timed steps use the default allocator)"
           if ok.get("exact_cpu_peak") else "ru_maxrss")
    lines.append(f"Peak memory: increase over model + batch + optimizer during all steps, by "
                 f"{mem}; '1st-step peak Δ': the same over the first step only; 'held after': "
                 "still allocated after the last step (MiB). The three agree unless memory grows "
                 "from step to step.")
    if args.amp == "fp16":
        lines.append("float16 autocast: non-DP training and Opacus scale the loss with "
                     "torch.amp.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); "
                     "scaler.update() — Opacus then clips the scaled per-sample gradients: timing "
                     "only); private_engine gets PrivacyEngine(grad_scaler=GradScaler).")
    elif args.amp == "bf16":
        lines.append("bfloat16 autocast around every method's forward (no loss scaling); "
                     f"weights in {args.dtype}.")
    if args.cuda_alloc_conf:
        lines.append(f"PYTORCH_CUDA_ALLOC_CONF={args.cuda_alloc_conf} for every method.")
    if any("max_batch" in r for r in results.values()):
        lines.append(f"Max batch: largest physical batch whose full step (two steps, fresh model) "
                     f"ran without CUDA out-of-memory, by doubling from {args.batch_size} then "
                     f"bisection (cap {args.max_batch_cap}"
                     + (f", stopped within {args.max_batch_tolerance:.0%} below the first size "
                        "that did not fit" if args.max_batch_tolerance else "") + ").")
        lines += oom_lines(results)
    return lines + target_lines(args, results)


def oom_lines(results: Dict[str, dict]) -> List[str]:
    """One line per method on the allocator at the out-of-memory error of the smallest batch that
    did not fit."""
    lines = []
    for m, r in results.items():
        o = r.get("max_batch_oom")
        if o:
            lines.append(f"{m} at batch {o['batch']} (first that did not fit): out of memory with "
                         f"{o['allocated_mib']:,.0f} MiB in tensors and "
                         f"{o['reserved_mib']:,.0f} MiB reserved "
                         f"({o['reserved_mib'] - o['allocated_mib']:,.0f} MiB free inside the "
                         f"allocator's segments); that attempt's peak in tensors "
                         f"{o['peak_allocated_mib']:,.0f} MiB"
                         + (f"; the request that failed: {o['request']}"
                            if o.get("request") else "")
                         + (f", raised in {o['where']}" if o.get("where") else "") + ".")
    return lines


def section_key(args) -> str:
    size = f"t{args.seq_len}" if args.model == TEXT_MODEL else str(args.img_size)
    return (f"{args.model}-{size}-b{args.batch_size}-{args.device}-{args.dtype}"
            + (f"-amp{args.amp}" if args.amp != "none" else "")
            + ("-noinplace" if args.no_inplace else "")
            + (f"-alloc-{args.cuda_alloc_conf}" if args.cuda_alloc_conf else "")
            + ("-oneprocess" if args.schedule == "one-process" else ""))


def title(args, info: Dict[str, str]) -> str:
    size = (f"{args.seq_len} tokens" if args.model == TEXT_MODEL
            else f"{args.img_size}×{args.img_size}")
    amp = f", {args.amp} autocast" if args.amp != "none" else ""
    where = ": timed in one process" if args.schedule == "one-process" else ""
    return (f"{args.model}, {size}, batch {args.batch_size}, {info['device']} "
            f"({args.dtype}{amp}){where}")


def markdown_section(args, results: Dict[str, dict], info: Dict[str, str]) -> str:
    key = section_key(args)
    body = [f"<!-- bench:{key} -->",
            f"### {title(args, info)}", "",
            f"- Date: {datetime.date.today().isoformat()}",
            f"- Machine: {info['machine']}; device: {info['device']}",
            f"- Software: {info['software']}; private_engine at commit {engine_revision()}",
            f"- Command: `{command_line()}`"]
    body += [f"- {line}" for line in setup_lines(args, results)]
    if args.plot:
        link = (Path(os.path.relpath(args.plot, Path(args.markdown).parent)).as_posix()
                if args.markdown else args.plot)
        body.append(f"- Figure (time and memory × non-DP, every model of this run): "
                    f"[{Path(args.plot).name}]({link})")
    body += ["", format_markdown(results_table(results, args.device == "cuda"))]
    vs = versus_opacus_table(results)
    if vs:
        body += ["", "private_engine vs Opacus (ratios below 1 favour private_engine):", "",
                 format_markdown(vs)]
    body += [f"<!-- /bench:{key} -->"]
    return "\n".join(body) + "\n"


def write_markdown(path: Path, section: str, key: str) -> None:
    """Replace this configuration's section in ``path`` (between its markers), or append it."""
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    text = (path.read_text() if path.exists()
            else "# Benchmarks\n\nWritten by `bench/bench_clipping.py`.\n")
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
