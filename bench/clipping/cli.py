"""The command line: the arguments of ``bench/bench_clipping.py``, checked and completed with the
per-device defaults, and the command line of the child process that runs one method."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import List, Optional

from .config import (
    AMP_DTYPES,
    CORE_METHODS,
    DEFAULT_METHODS,
    DEFAULT_MODELS,
    FROZEN,
    METHOD_SETS,
    METHODS,
    TEXT_MODEL,
    TOKEN_PARAMS,
)

#: the script every child process runs (with ``--only METHOD``), as the parent was run
SCRIPT = Path(__file__).resolve().parents[1] / "bench_clipping.py"


def description() -> str:
    """The first paragraph of the package's docstring, on one line (``--help``)."""
    from . import __doc__ as doc

    return " ".join(doc.split("\n\n")[0].split())


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", "--model", nargs="+", metavar="MODEL",
                   help=f"timm or torchvision model names (random init), or {TEXT_MODEL}; one "
                        f"table each; default {' '.join(DEFAULT_MODELS['cpu'])} on CPU, "
                        f"{' '.join(DEFAULT_MODELS['cuda'])} on CUDA")
    p.add_argument("--img-size", type=int, default=224,
                   help=f"input height = width (ignored by {TEXT_MODEL})")
    p.add_argument("--seq-len", type=int, default=128, help=f"tokens per sample of {TEXT_MODEL}")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the weights and images (pure low precision)")
    p.add_argument("--amp", default="none", choices=("none",) + tuple(AMP_DTYPES),
                   help="mixed precision: the forward of every method under torch.autocast "
                        "(fp16: with a GradScaler)")
    p.add_argument("--methods", nargs="+", choices=METHODS + tuple(METHOD_SETS), metavar="METHOD",
                   help=f"methods to run, from {', '.join(METHODS)}; or 'all', or 'core' "
                        f"({' '.join(CORE_METHODS)}). Default: core")
    p.add_argument("--freeze", nargs="*", default=[], metavar="GLOB",
                   help="also freeze parameters whose name matches a glob, for every method "
                        "(e.g. 'blocks.*')")
    p.add_argument("--frozen-set", nargs="+", default=list(TOKEN_PARAMS), metavar="GLOB",
                   help=f"parameters frozen in the *{FROZEN} methods "
                        f"(default: {' '.join(TOKEN_PARAMS)})")
    p.add_argument("--no-inplace", action="store_true",
                   help="set inplace=False on every module that has it (e.g. ReLU), for every "
                        "method: Opacus' full backward hooks reject in-place ops on the outputs "
                        "of hooked layers")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", default="auto",
                   choices=("auto", "interleaved", "sequential", "one-process"),
                   help="interleaved: one step of each method per round (robust to changing "
                        "background load); sequential: one method at a time (one subprocess "
                        "alive); one-process (CPU only): interleaved, every method timed in this "
                        "process (no process-to-process offset; memory is still measured per "
                        "subprocess). auto: interleaved on CPU, sequential on CUDA")
    p.add_argument("--max-batch", action="store_true",
                   help="CUDA only: also find each method's largest batch that fits in GPU "
                        "memory (doubling from --batch-size, then bisection), each method in a "
                        "fresh subprocess")
    p.add_argument("--max-batch-cap", type=int, default=4096,
                   help="largest batch --max-batch tries")
    p.add_argument("--max-batch-tolerance", type=float, default=0.0, metavar="FRACTION",
                   help="stop the --max-batch bisection once the largest size that fitted is "
                        "within this fraction of the smallest that did not (default 0: exact)")
    p.add_argument("--cuda-alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF for every method's subprocess (e.g. "
                        "expandable_segments:True: the caching allocator grows segments instead "
                        "of splitting fixed ones; compare max batches)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds allowed for building a method, one step, or one method's "
                        "--max-batch search")
    p.add_argument("--markdown", metavar="PATH",
                   help="write (or replace) this run's section in a markdown file")
    p.add_argument("--plot", metavar="PATH",
                   help="write a figure (png) of time and memory × non-DP per method, one panel "
                        "per model; with --markdown the default is benchmarks_<device>.png next "
                        "to the markdown file")
    # internal: run one method, print JSON
    p.add_argument("--only", choices=METHODS, help=argparse.SUPPRESS)
    # internal, with --only
    p.add_argument("--probe-max-batch", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.schedule == "auto":
        args.schedule = "sequential" if args.device == "cuda" else "interleaved"
    if args.schedule == "one-process" and args.device != "cpu":
        p.error("--schedule one-process is for the CPU (on a GPU every method's model and memory "
                "would share it)")
    if not args.models:
        args.models = list(DEFAULT_MODELS[args.device])
    if args.only and len(args.models) != 1:
        p.error("--only runs one model")
    args.model = args.models[0]
    args.methods = select_methods(args.methods or DEFAULT_METHODS[args.device])
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be ≥ 1 and --warmup ≥ 0")
    if args.batch_size < 1 or args.seq_len < 1:
        p.error("--batch-size and --seq-len must be ≥ 1")
    if (args.max_batch or args.probe_max_batch) and args.device != "cuda":
        p.error("--max-batch needs --device cuda: it searches for the batch at which a step runs "
                "out of GPU memory; on CPU there is no such error to find (the machine would swap "
                "or the process be killed)")
    if not 0.0 <= args.max_batch_tolerance < 1.0:
        p.error(f"--max-batch-tolerance ({args.max_batch_tolerance}) must be in [0, 1)")
    if args.max_batch and args.max_batch_cap < args.batch_size:
        p.error(f"--max-batch-cap ({args.max_batch_cap}) must be ≥ --batch-size "
                f"({args.batch_size})")
    args.plot_default = False
    has_matplotlib = args.only or importlib.util.find_spec("matplotlib") is not None
    if args.markdown and not args.plot and not args.only:
        if has_matplotlib:
            args.plot = str(Path(args.markdown).parent / f"benchmarks_{args.device}.png")
            args.plot_default = True
        else:
            print("note: no figure (matplotlib is not installed: pip install -e '.[plot]')",
                  file=sys.stderr)
    elif args.plot and not has_matplotlib:  # fail now, not after the whole benchmark
        p.error("--plot needs matplotlib: pip install -e '.[plot]'")
    return args


def select_methods(names: List[str]) -> List[str]:
    """Expand the shortcuts ('all', 'core') and return the methods in the order of ``METHODS``."""
    chosen = set()
    for name in names:
        chosen.update(METHOD_SETS.get(name, (name,)))
    return [m for m in METHODS if m in chosen]


#: options forwarded from the parent to each per-method subprocess (the parent counts the steps)
FORWARDED = ("model", "img_size", "seq_len", "batch_size", "num_classes", "device", "dtype", "amp",
             "freeze", "frozen_set", "no_inplace", "max_grad_norm", "noise_multiplier", "lr",
             "seed", "max_batch_cap", "max_batch_tolerance")


def child_command(args: argparse.Namespace, method: str,
                  probe_max_batch: bool = False) -> List[str]:
    """The command line of the subprocess that runs ``method`` with the parent's settings."""
    cmd = [sys.executable, str(SCRIPT), "--only", method] + (["--probe-max-batch"]
                                                             if probe_max_batch else [])
    for name in FORWARDED:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd += [flag] if value else []
        elif isinstance(value, list):
            if value:
                cmd += [flag, *map(str, value)]
        else:
            cmd += [flag, str(value)]
    return cmd


def parse_with_benchmark_options(parser: argparse.ArgumentParser, argv, steps_attr: str
                                 ) -> argparse.Namespace:
    """For the investigation scripts: their own options (``parser``, which has ``--methods`` and
    ``--steps``), the benchmark's for the rest (model, batch, device, autocast…); their
    ``--steps`` lands in ``steps_attr``, and ``args.model`` is the first of ``--models``."""
    own, rest = parser.parse_known_args(argv)
    args = parse_args(rest + ["--methods", *own.methods])
    for k, v in vars(own).items():
        setattr(args, k if k != "steps" else steps_attr, v)
    args.model = args.models[0]
    return args
