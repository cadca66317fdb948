"""The live tensor memory of one training step over time, per method, and what it is made of at
its peak: deterministic (counted, not sampled), on any device.

    python bench/investigate/live_memory.py --model vit_base_patch16_224 --img-size 224 \\
        --batch-sizes 2 4 --methods nondp bk_mixed

A ``TorchDispatchMode`` (below autograd: the backward's operators too) sees every operator of a
step after ``--warmup`` steps. Each storage an operator creates (outputs that alias no input) is
counted once, with its bytes, from its creation until it is freed (a weak reference to the
storage: views and aliases are never counted twice). Storages that existed before the step
(parameters, optimizer state, the batch) are not counted: the figures are what the step adds.
Each storage is labelled by what made it:

* ``fwd <Module>``: created in the forward inside that (innermost) module type — activations
  autograd saves, and copies of them;
* ``bwd <Node>``: created by the autograd backward node ``<Node>`` outside the library's code —
  the gradients flowing back (activation gradients, output gradients a clipping layer keeps,
  parameter gradients);
* ``pe <file>:<function>``: created by the library's code (the innermost frame of
  ``private_engine``), e.g. Grams, per-sample gradients, clipped-sum buffers, noise;
* ``other <op>``: anything else (the loss, the optimizer's update).

For each method and batch size it prints the step's peak of live bytes, the phase in which it
occurs (forward / backward / after), the peak of each phase, and the composition of the peak per
label; with two batch sizes, also what each label costs per sample at the peak (its growth with
the batch, what bounds the largest batch that fits). Figures are bytes of storages (``nbytes``),
not of the allocator's blocks. The benchmark's options (``--model``, ``--img-size``, ``--amp``,
``--dtype``, …) are passed on to it; ``--batch-size`` is replaced by ``--batch-sizes``.
"""
from __future__ import annotations

import argparse
import sys
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: package `bench`
from bench.clipping import cli  # noqa: E402
from bench.clipping.config import METHODS  # noqa: E402
from bench.clipping.methods import SETUPS  # noqa: E402
from bench.clipping.models import build_model, make_batch  # noqa: E402

MIB = 2 ** 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["nondp", "bk_mixed"], choices=METHODS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[2, 4],
                   help="batch sizes measured (two or more: the per-sample growth is shown)")
    p.add_argument("--steps", type=int, default=1, help="steps recorded (the peak is the max)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", type=int, default=25, help="labels shown per composition")
    return cli.parse_with_benchmark_options(p, argv, "record_steps")


def _tensors(x) -> List:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


def _library_site() -> Optional[str]:
    """``pe <file>:<function>`` of the innermost frame of private_engine (its guards' own
    dispatch modes skipped), or None; also None when the innermost frame outside torch is the
    autograd engine's (an operator of a backward node, not of the library's code)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if frame.f_code.co_name == "_engine_run_backward" or path.endswith(
                ("torch/autograd/__init__.py", "torch/_tensor.py")):
            return None  # the library called the backward; the operator is the backward's
        i = path.rfind("private_engine/")
        if i >= 0 and "/guards/" not in path:
            return f"pe {path[i + len('private_engine/'):]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


class LiveTracker:
    """Counts every storage created under it (see the module docstring) into an event log:
    ``events[k] = (+bytes or -bytes, label index, phase)``; :meth:`peak` replays it."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.events: List[Tuple[int, int, str]] = []
        self.labels: List[str] = []
        self._label_ids: Dict[str, int] = {}
        self._live: Dict[int, int] = {}  # id(storage) -> event index of its creation
        self.modules: List[str] = []  # forward stack of module type names
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                returns = func._schema.returns
                if any(r.alias_info is not None for r in returns):
                    return out  # views and in-place/out= results: no new storage
                for t in _tensors(out):
                    tracker._created(t, func)
                return out

        self.mode = Mode()
        self._torch = torch

    def _label(self, func) -> Tuple[str, str]:
        node = self._torch._C._current_autograd_node()
        phase = "backward" if node is not None else ("forward" if self.modules else "after")
        site = _library_site()
        if site is not None:
            return site, phase
        if node is not None:
            return f"bwd {type(node).__name__}", phase
        if self.modules:
            return f"fwd {self.modules[-1]}", phase
        return f"other {func.overloadpacket.__name__}", phase

    def _created(self, t, func) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        label, phase = self._label(func)
        idx = self._label_ids.setdefault(label, len(self._label_ids))
        if idx == len(self.labels):
            self.labels.append(label)
        self._live[key] = len(self.events)
        self.events.append((nbytes, idx, phase))
        weakref.finalize(storage, self._freed, key, nbytes, idx)

    def _freed(self, key: int, nbytes: int, idx: int) -> None:
        if self._live.pop(key, None) is not None:
            node = self._torch._C._current_autograd_node()
            phase = "backward" if node is not None else ("forward" if self.modules else "after")
            self.events.append((-nbytes, idx, phase))

    def __enter__(self):
        from torch.nn.modules import module as module_mod

        def pre(module, inputs):
            self.modules.append(type(module).__name__)

        def post(module, inputs, output):
            if self.modules:
                self.modules.pop()

        self._hooks = [module_mod.register_module_forward_pre_hook(pre),
                       module_mod.register_module_forward_hook(post, always_call=True)]
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        return False

    def peak(self) -> Tuple[int, str, Dict[str, int], Dict[str, int]]:
        """``(peak bytes, phase at the peak, {label: bytes live at the peak},
        {phase: its peak})``, replaying the event log."""
        live = best = 0
        best_at, best_phase = -1, "-"
        per_phase: Dict[str, int] = defaultdict(int)
        for k, (nbytes, _, phase) in enumerate(self.events):
            live += nbytes
            per_phase[phase] = max(per_phase[phase], live)
            if live > best:
                best, best_at, best_phase = live, k, phase
        by_label: Dict[str, int] = defaultdict(int)
        for nbytes, idx, _ in self.events[:best_at + 1]:
            by_label[self.labels[idx]] += nbytes
        return best, best_phase, {k: v for k, v in by_label.items() if v}, dict(per_phase)


def measure(method: str, batch_size: int, args) -> dict:
    """One method at one batch size: the peak of live bytes of a step and its composition."""
    args.batch_size = batch_size
    model, _ = build_model(args, method)
    x, y = make_batch(args)
    runner = SETUPS[method](model, x, y, args)
    for _ in range(args.warmup):
        runner.step()
    result: dict = {"peak": -1}
    for _ in range(args.record_steps):
        with LiveTracker() as tracker:
            runner.step()
        peak, phase, labels, phases = tracker.peak()
        if peak > result["peak"]:
            result = {"peak": peak, "phase": phase, "labels": labels, "phases": phases}
        del tracker
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    result["params"] = params
    del runner, model
    return result


def _kind(label: str) -> str:
    """A label's family: forward activations, backward gradients, the library's own, other."""
    return {"fwd": "forward (activations)", "bwd": "backward (gradients)",
            "pe": "private_engine", "other": "other"}[label.split(" ", 1)[0]]


def report(method: str, results: Dict[int, dict], rows: int) -> List[str]:
    sizes = sorted(results)
    lines = [f"== {method} =="]
    for n in sizes:
        r = results[n]
        phases = ", ".join(f"{k} {v / MIB:.1f}" for k, v in sorted(r["phases"].items()))
        lines.append(f"batch {n}: peak {r['peak'] / MIB:.1f} MiB over the step's start "
                     f"(parameters {r['params'] / MIB:.1f} MiB), in the {r['phase']}; "
                     f"peak per phase (MiB): {phases}")
    lo, hi = sizes[0], sizes[-1]
    labels = sorted(set(results[hi]["labels"]) | set(results[lo]["labels"]),
                    key=lambda k: -results[hi]["labels"].get(k, 0))
    kinds: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0])
    for k in labels:
        kinds[_kind(k)][0] += results[hi]["labels"].get(k, 0)
        kinds[_kind(k)][1] += results[lo]["labels"].get(k, 0)
    per = hi - lo
    head = f"{'MiB at peak (batch ' + str(hi) + ')':>24}"
    head += f" {'MiB/sample':>11}" if per else ""
    lines.append(head + "  what")
    for k, (b_hi, b_lo) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        row = f"{b_hi / MIB:24.2f}"
        row += f" {(b_hi - b_lo) / per / MIB:11.3f}" if per else ""
        lines.append(row + f"  [{k}]")
    for k in labels[:rows]:
        b_hi = results[hi]["labels"].get(k, 0)
        b_lo = results[lo]["labels"].get(k, 0)
        row = f"{b_hi / MIB:24.2f}"
        row += f" {(b_hi - b_lo) / per / MIB:11.3f}" if per else ""
        lines.append(row + f"    {k}")
    return lines


def main(argv=None) -> Dict[str, Dict[int, dict]]:
    args = parse_args(argv)
    out: Dict[str, Dict[int, dict]] = {}
    for method in args.methods:
        out[method] = {n: measure(method, n, args) for n in args.batch_sizes}
        print("\n".join(report(method, out[method], args.rows)), flush=True)
    base = out.get("nondp")
    if base is not None:
        for method, res in out.items():
            if method == "nondp":
                continue
            total = {n: (res[n]["peak"] + res[n]["params"])
                     / (base[n]["peak"] + base[n]["params"]) for n in res}
            ratios = " ".join(f"batch {n}: {total[n]:.3f}×" for n in sorted(res))
            lines = [f"{method} / nondp, peak incl. parameters: {ratios}"]
            sizes = sorted(res)
            if len(sizes) > 1:
                lo, hi = sizes[0], sizes[-1]
                slope = (res[hi]["peak"] - res[lo]["peak"]) / (hi - lo)
                slope0 = (base[hi]["peak"] - base[lo]["peak"]) / (hi - lo)
                lines.append(f"{method} / nondp, peak growth per sample: "
                             f"{slope / MIB:.2f} / {slope0 / MIB:.2f} MiB = {slope / slope0:.3f}×")
            print("\n".join(lines), flush=True)
    return out


if __name__ == "__main__":
    main()
