"""The data movement of one training step, per method: every copy-like operator (copy_,
_to_copy, cat, stack, pad, clone, fill_, zero_, …) and every other operator (element-wise,
reduction; matmuls, convolutions and views left out) with a tensor of at least ``N·T·min(T, 192)``
elements (an ``(N, T, T)`` Gram, an ``(N, T, D)`` activation), with its shapes, dtypes, the bytes
it reads and writes, and the Python line of the library (or of the model) that called it.

    python bench/investigate/data_movement.py --model vit_base_patch16_224 --img-size 64 \\
        --amp bf16 --batch-size 4 --methods nondp bk_mixed --steps 2

Recorded by a ``TorchDispatchMode`` (below autograd: the backward's operators too) over
``--steps`` steps after ``--warmup``; prints per method the totals per step (operators, bytes;
split by the kind of the largest tensor: Grams ``(…, T, T)``, operands with T positions, other,
e.g. weights) and one row per (operator, call site, shapes), biggest bytes first. The bytes are
those of the operator's tensor inputs and outputs (what a GPU kernel reads and writes). On the
CPU, 16-bit operands of the Grams and of the clipped sums are widened to float32 (casts a GPU does
not make), the Gram operands are not padded (a GPU pads 16-bit ones to a multiple of 8
positions), and whether operands of one shape are stacked depends on their size (ViT-B/16 at 224²
and batch 128 stacks none). The benchmark's options (``--model``, ``--img-size``, ``--amp``, …)
are passed on to it.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: package `bench`
from bench.clipping import cli  # noqa: E402
from bench.clipping.config import METHODS  # noqa: E402
from bench.clipping.methods import SETUPS  # noqa: E402
from bench.clipping.models import build_model, make_batch  # noqa: E402

#: operators that only move or fill memory
COPIES = {"copy_", "_to_copy", "cat", "stack", "constant_pad_nd", "clone", "fill_", "zero_",
          "zeros", "zeros_like", "new_zeros", "full", "index_put_", "index_select", "repeat",
          "repeat_interleave", "_unsafe_view"}
#: matmuls and convolutions: arithmetic, not data movement
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "convolution", "convolution_backward",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward", "im2col", "col2im"}
#: where a call site is looked for, innermost first
_OWN = ("private_engine", "timm", "bench")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["nondp", "bk_mixed"], choices=METHODS)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", type=int, default=40, help="rows shown per method")
    p.add_argument("--positions", type=int,
                   help="T, the positions per sample (default: the sequence length of a text "
                        "model, else (img-size/16)² + 1, a ViT/16's)")
    return cli.parse_with_benchmark_options(p, argv, "record_steps")


def _site() -> str:
    """The innermost frame of the library (its guards' own dispatch modes skipped), timm or the
    benchmark: ``file:line function``; an operator of the backward pass is attributed to the line
    that ran the backward."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        parts = Path(frame.filename).parts
        if "guards" in parts:
            continue
        for name in _OWN:
            if name in parts:
                rel = "/".join(parts[parts.index(name):])
                return f"{rel}:{frame.lineno} {frame.name}"
    return "?"


def _is_view(func) -> bool:
    """An operator that returns a view of an input (nothing moved); in-place operators, which
    also return an input, are not views."""
    returns = func._schema.returns
    return any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _tensors(x) -> List:
    import torch

    out = []
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            out.extend(_tensors(y))
    elif isinstance(x, dict):
        for y in x.values():
            out.extend(_tensors(y))
    return out


def recorder(threshold: int):
    """A dispatch mode that records what :func:`__doc__` lists into ``mode.rows``:
    ``{(op, site, shapes): [calls, bytes]}``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: Dict[Tuple[str, str, str], List[int]] = defaultdict(lambda: [0, 0])

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            ins, outs = _tensors((args, kwargs or {})), _tensors(out)
            big = max((t.numel() for t in ins + outs), default=0)
            if name in COPIES or (big >= threshold and name not in MATMULS
                                  and not name.startswith(("empty", "new_empty"))
                                  and not _is_view(func)):
                if name in ("_unsafe_view",):
                    return out
                moved = sum(t.numel() * t.element_size() for t in ins + outs)
                shapes = " ".join(f"{tuple(t.shape)}:{str(t.dtype)[6:]}" for t in ins + outs)
                row = self.rows[(name, _site(), shapes)]
                row[0] += 1
                row[1] += moved
            return out

    return Record()


def _kind(shapes: str, N: int, T: int) -> str:
    """What the operator's largest tensor is: ``gram`` when it ends with ``(…, T, T)``,
    ``operand`` when it has a dimension of T positions (an activation, an output gradient, a stack
    of them), else ``other`` (weights, noise, per-sample vectors)."""
    tensors = [[int(d) for d in item.split(",") if d.strip()]
               for item in re.findall(r"\(([^)]*)\)", shapes)]
    dims = max(tensors, key=math.prod, default=[])
    if len(dims) >= 3 and dims[-1] == dims[-2] == T:
        return "gram"
    return "operand" if T in dims else "other"


def record_method(method: str, args) -> Tuple[str, Dict[str, float]]:
    """The table of ``method`` and its totals per step."""
    model, _ = build_model(args, method)
    x, y = make_batch(args)
    runner = SETUPS[method](model, x, y, args)
    for _ in range(args.warmup):
        runner.step()
    T = args.positions or (args.seq_len if "text" in args.model else
                           (args.img_size // 16) ** 2 + 1)
    threshold = args.batch_size * T * min(T, 192)
    mode = recorder(threshold)
    with mode:
        for _ in range(args.record_steps):
            runner.step()
    steps = args.record_steps
    rows = sorted(mode.rows.items(), key=lambda kv: -kv[1][1])
    calls = sum(v[0] for _, v in rows) / steps
    moved = sum(v[1] for _, v in rows) / steps
    copies = sum(v[1] for (op, _, _), v in rows if op in COPIES) / steps
    lines = [f"== {method}: {calls:.0f} operators per step, {moved / 2**20:.1f} MiB moved per "
             f"step ({copies / 2**20:.1f} MiB by copy/fill operators) =="]
    totals = {"calls": calls, "bytes": moved, "copy_bytes": copies}
    for kind in ("gram", "operand", "other"):
        mine = [(k, v) for k, v in rows if _kind(k[2], args.batch_size, T) == kind]
        for label, pick in (("copy/fill", lambda op: op in COPIES),
                            ("element-wise", lambda op: op not in COPIES)):
            n = sum(v[0] for (op, _, _), v in mine if pick(op)) / steps
            b = sum(v[1] for (op, _, _), v in mine if pick(op)) / steps
            totals[f"{kind} {label}"] = b
            lines.append(f"   {kind:>7} {label:<12}: {n:5.0f} operators, {b / 2**20:8.2f} MiB")
    lines.append(f"{'calls':>6} {'MiB':>8}  {'op':<18} site | shapes")
    for (op, site, shapes), (n, b) in rows[:args.rows]:
        lines.append(f"{n / steps:6.0f} {b / steps / 2**20:8.2f}  {op:<18} {site} | {shapes}")
    return "\n".join(lines), totals


def main(argv=None) -> Dict[str, Dict[str, float]]:
    args = parse_args(argv)
    totals = {}
    for method in args.methods:
        text, totals[method] = record_method(method, args)
        print(text, flush=True)
    assert all(math.isfinite(v) for t in totals.values() for v in t.values())
    return totals


if __name__ == "__main__":
    main()
