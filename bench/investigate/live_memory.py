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

For each method and batch size it prints the step's peak of live bytes and the peak of each
phase: ``forward`` (inside a module's forward), ``loss`` (outside modules, before the first
backward operator), ``backward`` (inside an autograd node, the library's hooks there included)
and ``after`` (outside both, once a backward ran: the clipping after the backward, the noise,
the update); then, at the largest batch size, the composition of each
phase's peak per label and, with two batch sizes, its growth per sample (what bounds the largest
batch that fits). Figures are bytes of storages (``nbytes``), not of the allocator's blocks: a
CUDA caching allocator's rounding and fragmentation, and workspaces outside tensors, are not
seen. The benchmark's options (``--model``, ``--img-size``, ``--amp``,
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


#: the library's torch function and dispatch modes: they pass the model's operators on
_PASS_THROUGH = ("__torch_function__", "__torch_dispatch__")


def _library_site() -> Optional[str]:
    """``pe <file>:<function>`` of the innermost frame of private_engine (its guards and its
    torch function/dispatch modes, which pass the model's operators on, skipped), or None; also
    None when the innermost frame outside torch is the autograd engine's (an operator of a
    backward node, not of the library's code)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if frame.f_code.co_name == "_engine_run_backward" or path.endswith(
                ("torch/autograd/__init__.py", "torch/_tensor.py")):
            return None  # the library called the backward; the operator is the backward's
        i = path.rfind("private_engine/")
        if i >= 0 and "/guards/" not in path and frame.f_code.co_name not in _PASS_THROUGH:
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
        self._backward_seen = False
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

    def _phase(self, node) -> str:
        """``backward`` inside an autograd node, ``forward`` inside a module, else ``loss``
        before the first backward and ``after`` once one ran."""
        if node is not None:
            self._backward_seen = True
            return "backward"
        if self.modules:
            return "forward"
        return "after" if self._backward_seen else "loss"

    def _label(self, func) -> Tuple[str, str]:
        node = self._torch._C._current_autograd_node()
        phase = self._phase(node)
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
            phase = self._phase(node)
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

    def peaks(self) -> Dict[str, Tuple[int, Dict[str, int]]]:
        """``{phase: (its peak of live bytes, {label: bytes live then})}``, phases ``forward``,
        ``loss``, ``backward``, ``after`` and ``step`` (the whole step's peak), replaying the
        event log."""
        live = 0
        best: Dict[str, Tuple[int, int]] = {}  # phase -> (peak, event index)
        for k, (nbytes, _, phase) in enumerate(self.events):
            live += nbytes
            for key in (phase, "step"):
                if key not in best or live > best[key][0]:
                    best[key] = (live, k)
        out = {}
        for phase, (peak, at) in best.items():
            by_label: Dict[str, int] = defaultdict(int)
            for nbytes, idx, _ in self.events[:at + 1]:
                by_label[self.labels[idx]] += nbytes
            out[phase] = (peak, {k: v for k, v in by_label.items() if v})
        return out


#: the phases reported, in order
PHASES = ("forward", "loss", "backward", "after", "step")


def measure(method: str, batch_size: int, args) -> dict:
    """One method at one batch size: ``{phase: (peak bytes, {label: bytes})}`` (the largest
    over the recorded steps) and ``"params"``: the parameters' bytes."""
    args.batch_size = batch_size
    model, _ = build_model(args, method)
    x, y = make_batch(args)
    runner = SETUPS[method](model, x, y, args)
    for _ in range(args.warmup):
        runner.step()
    result: dict = {}
    for _ in range(args.record_steps):
        with LiveTracker() as tracker:
            runner.step()
        for phase, (peak, labels) in tracker.peaks().items():
            if phase not in result or peak > result[phase][0]:
                result[phase] = (peak, labels)
        del tracker
    result["params"] = sum(p.numel() * p.element_size() for p in model.parameters())
    del runner, model
    return result


def _kind(label: str) -> str:
    """A label's family: forward activations, backward gradients, the library's own, other."""
    return {"fwd": "forward (activations)", "bwd": "backward (gradients)",
            "pe": "private_engine", "other": "other"}[label.split(" ", 1)[0]]


def report(method: str, results: Dict[int, dict], rows: int) -> List[str]:
    """The peaks of each phase per batch size, then the composition of each phase's peak at the
    largest batch size (MiB) and, with two batch sizes, its growth per sample (MiB/sample)."""
    sizes = sorted(results)
    lo, hi = sizes[0], sizes[-1]
    per = hi - lo
    phases = [ph for ph in PHASES if ph in results[hi]]
    lines = [f"== {method} (parameters {results[hi]['params'] / MIB:.1f} MiB; MiB over the "
             f"step's start) =="]
    for n in sizes:
        lines.append(f"batch {n}: peak " + ", ".join(
            f"{ph} {results[n][ph][0] / MIB:.1f}" for ph in phases if ph in results[n]))
    if per:
        lines.append("growth per sample: " + ", ".join(
            f"{ph} {(results[hi][ph][0] - results[lo][ph][0]) / per / MIB:.2f}"
            for ph in phases if ph in results[lo]))

    def at(n, ph, label):
        return results[n].get(ph, (0, {}))[1].get(label, 0) if ph in results[n] else 0

    labels = sorted({k for ph in phases for k in results[hi][ph][1]},
                    key=lambda k: -max(at(hi, ph, k) for ph in phases))
    head = "".join(f"{ph + ' MiB':>14}" + (f"{'/sample':>9}" if per else "") for ph in phases)
    growth = f", growth from batch {lo}" if per else ""
    lines.append(f"composition at each phase's peak (batch {hi}{growth}):")
    lines.append(head + "  what")

    def row(values) -> str:
        out = ""
        for ph in phases:
            b_hi, b_lo = values(hi, ph), values(lo, ph)
            out += f"{b_hi / MIB:14.2f}" + (f"{(b_hi - b_lo) / per / MIB:9.2f}" if per else "")
        return out

    kinds = sorted({_kind(k) for k in labels})
    for kind in kinds:
        lines.append(row(lambda n, ph: sum(v for k, v in results[n][ph][1].items()
                                           if _kind(k) == kind) if ph in results[n] else 0)
                     + f"  [{kind}]")
    for k in labels[:rows]:
        lines.append(row(lambda n, ph: at(n, ph, k)) + f"    {k}")
    return lines


def main(argv=None) -> Dict[str, Dict[int, dict]]:
    args = parse_args(argv)
    out: Dict[str, Dict[int, dict]] = {}
    for method in args.methods:
        out[method] = {n: measure(method, n, args) for n in args.batch_sizes}
        print("\n".join(report(method, out[method], args.rows)), flush=True)
    base = out.get("nondp")
    for method, res in out.items():
        if base is None or method == "nondp":
            continue
        sizes = sorted(res)
        total = {n: (res[n]["step"][0] + res[n]["params"])
                 / (base[n]["step"][0] + base[n]["params"]) for n in sizes}
        lines = [f"{method} / nondp, step peak with the parameters: "
                 + " ".join(f"batch {n}: {total[n]:.3f}×" for n in sizes)]
        if len(sizes) > 1:
            lo, hi = sizes[0], sizes[-1]
            for ph in ("step", "backward"):
                slope = (res[hi][ph][0] - res[lo][ph][0]) / (hi - lo)
                slope0 = (base[hi]["step"][0] - base[lo]["step"][0]) / (hi - lo)
                lines.append(f"{method} {ph} peak / nondp step peak, growth per sample: "
                             f"{slope / MIB:.2f} / {slope0 / MIB:.2f} MiB = {slope / slope0:.3f}×")
        print("\n".join(lines), flush=True)
    return out


if __name__ == "__main__":
    main()
