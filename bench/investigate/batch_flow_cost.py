"""Host cost of the batch flow (``private_engine/guards/batch_flow``) in a private step, on the
CPU proxy of ``host_overhead.py`` (ViT-B/16's structure at width 64, 2 tokens, batch 2, one
thread): the ``TorchDispatchMode`` that follows every aten op of the step's forward and loss.

    python bench/investigate/batch_flow_cost.py
    python bench/investigate/batch_flow_cost.py --mode bk --rounds 12 --floor
    python bench/investigate/batch_flow_cost.py --other /tmp/base   # and another checkout's

Three steps alternate round by round in one process, so that the machine's load drifts over all
alike: ``nondp`` (a non-private SGD step), ``dp`` (a private step) and ``dp_noflow`` (the same
private step with the batch flow switched off: its regions never open, its loss check passes).
``flow = dp − dp_noflow`` is the batch flow's time per step. ``--floor`` adds ``dp_passthrough``:
the mode on the dispatch stack passing every op through untouched, the cost of any dispatch-mode
tracker (``dp_passthrough − dp_noflow``). ``--other DIR`` measures the ``private_engine`` of
another checkout too (``other_dp``, ``other_dp_noflow``), loaded side by side as in
``host_ab.py``.

Prints the median milliseconds per step of each (over ``--rounds`` rounds of ``--steps`` steps)
and the flow's share; returns them from ``main()``.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # this checkout
sys.path.insert(0, str(ROOT))
from bench.investigate.host_ab import load_package  # noqa: E402
from bench.investigate.host_overhead import build_proxy, nondp_step, proxy_batch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="bk_mixed", help="private_engine clipping mode")
    p.add_argument("--width", type=int, default=64, help="the proxy's embed_dim")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    p.add_argument("--floor", action="store_true",
                   help="also time the mode passing every op through (dp_passthrough)")
    p.add_argument("--other", help="root of another private_engine checkout to time as well")
    return p.parse_args(argv)


@contextlib.contextmanager
def _patched(cls, **attrs):
    """``cls``'s attributes replaced by ``attrs`` for the ``with`` block."""
    saved = {k: cls.__dict__[k] for k in attrs}
    for k, v in attrs.items():
        setattr(cls, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cls, k, v)


def _variants(pe, x, y, args, prefix: str, floor: bool) -> dict:
    """The private step of package ``pe`` as ``{name: (step, patch)}``: with the batch flow, without
    it (``_open`` and ``check_loss`` do nothing) and, with ``floor``, with a mode that passes
    every op through (``__torch_dispatch__`` only calls the op; ``check_loss`` only ends the
    region, taking the mode off the dispatch stack)."""
    import torch
    import torch.nn.functional as F

    model = build_proxy(width=args.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pe.PrivacyEngine(model, batch_size=x.shape[0], sample_size=100 * x.shape[0],
                     max_grad_norm=1.0, noise_multiplier=1.0, clipping_mode=args.mode,
                     check_sampling=False).attach(opt)  # fixed batches: timing only

    def step():
        opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))
        opt.zero_grad(set_to_none=True)

    flow = sys.modules[pe.__name__ + ".guards.batch_flow.mode"].BatchFlow

    def passthrough(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    def nothing(*a, **k):
        return None

    def end(self, *a, **k):
        self.end()

    out = {prefix + "dp": (step, contextlib.nullcontext),
           prefix + "dp_noflow": (step, lambda: _patched(flow, _open=nothing,
                                                         check_loss=nothing))}
    if floor:
        raw = torch._disable_dynamo(passthrough, recursive=True)  # as TorchDispatchMode wraps it
        out[prefix + "dp_passthrough"] = (step, lambda: _patched(
            flow, __torch_dispatch__=raw, check_loss=end))
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # host cost: one thread, as one Python thread feeds a GPU
    x, y = proxy_batch()
    steps = {"nondp": (nondp_step(build_proxy(width=args.width), x, y), contextlib.nullcontext)}
    import private_engine

    steps.update(_variants(private_engine, x, y, args, "", args.floor))
    if args.other:
        steps.update(_variants(load_package("_pe_other", Path(args.other)), x, y, args,
                               "other_", False))
    for step, patch in steps.values():  # the first steps run the probes
        with patch():
            for _ in range(3):
                step()
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, (step, patch) in steps.items():
            with patch():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
    result = {k: statistics.median(v) for k, v in times.items()}
    for prefix in ("", "other_") if args.other else ("",):
        result[prefix + "flow"] = result[prefix + "dp"] - result[prefix + "dp_noflow"]
    print(f"{args.mode}, median ms/step over {args.rounds} rounds of {args.steps} steps: "
          + "  ".join(f"{k} {v:.2f}" for k, v in result.items()))
    print(f"batch flow: {result['flow']:.2f} ms/step = "
          f"{100 * result['flow'] / result['dp']:.0f}% of the private step"
          + (f" (other: {result['other_flow']:.2f} ms/step)" if args.other else ""))
    return result


if __name__ == "__main__":
    main()
