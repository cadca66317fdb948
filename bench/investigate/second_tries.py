"""Second tries of loose ghost bounds per private step, this checkout against another one, in one
process: the samples handed to ``second_try`` (per operand shape) and the time spent in it, the
two checkouts' steps alternating round by round (as ``host_ab.py``).

    git worktree add /tmp/base <commit>
    python bench/investigate/second_tries.py --other /tmp/base --mode mixed --rounds 8

The model is built as the clipping benchmark builds it (random init, 10 classes), on
``torch.randn`` images: noise inputs, whose image patches are nearly orthogonal.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.investigate.host_ab import load_package  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", required=True, help="root of another private_engine checkout")
    p.add_argument("--mode", default="mixed", help="clipping mode (both checkouts)")
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8)
    return p.parse_args(argv)


def watch(package, name: str, spent: dict, samples: collections.Counter) -> None:
    """Time and count the calls of ``second_try`` (per layer and stacked) of one package."""
    gram = sys.modules[package.__name__ + ".layers.gram"]
    stack = sys.modules[package.__name__ + ".layers.ghost_stack"]
    for module, fn in ((gram, "second_try"), (stack, "second_try"),
                       (stack, "second_try_rows")):
        own = getattr(module, fn)

        def timed(*args, _own=own, **kw):
            a = args[0]
            n = args[6].numel() if len(args) > 6 and hasattr(args[6], "numel") else a.shape[0]
            samples[(name, tuple(a.shape[1:]))] += n
            t0 = time.perf_counter()
            out = _own(*args, **kw)
            spent[name] += time.perf_counter() - t0
            return out

        setattr(module, fn, timed)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    from bench.clipping import cli
    from bench.clipping.models import build_model

    packages = {"this": load_package("_pe_this", ROOT),
                "other": load_package("_pe_other", Path(args.other))}
    spent = {k: 0.0 for k in packages}
    samples: collections.Counter = collections.Counter()
    for name, pe in packages.items():
        watch(pe, name, spent, samples)
    bench_args = cli.parse_args(["--model", args.model, "--img-size", str(args.img_size),
                                 "--device", "cpu", "--methods", "nondp"])
    bench_args.model = args.model
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    steps = {}
    for name, pe in packages.items():
        model = build_model(bench_args)[0]
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        pe.PrivacyEngine(model, batch_size=x.shape[0], sample_size=100 * x.shape[0],
                         max_grad_norm=1.0, noise_multiplier=1.0, clipping_mode=args.mode,
                         check_sampling=False).attach(opt)

        def dp(model=model, opt=opt):
            opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))
            opt.zero_grad(set_to_none=True)

        steps[name] = dp
        dp()
    samples.clear()
    in_tries = {k: [] for k in steps}
    totals = {k: [] for k in steps}
    for r in range(args.rounds):
        for name in list(steps)[::1 if r % 2 == 0 else -1]:
            spent[name] = 0.0
            t0 = time.perf_counter()
            steps[name]()
            totals[name].append(time.perf_counter() - t0)
            in_tries[name].append(spent[name])
    for name in steps:
        shapes = {s: n // args.rounds for (k, s), n in samples.items() if k == name}
        share = statistics.median(a / b for a, b in zip(in_tries[name], totals[name]))
        print(f"{args.mode} {name}: second tries {1e3 * statistics.median(in_tries[name]):.1f} ms"
              f" per step (median), step {1e3 * statistics.median(totals[name]):.0f} ms, share "
              f"{share:.3f}; samples per step by (T, width): {shapes}")


if __name__ == "__main__":
    main()
