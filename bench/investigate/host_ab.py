"""Host cost of a private step, this checkout against another one, in one process.

The CPU proxy of ``host_overhead.py`` (ViT-B/16's structure at width 64, 2 tokens, batch 2, one
thread), with two private_engine packages loaded side by side — this tree's and the one under
``--other`` (e.g. a ``git worktree`` of an older commit) — and their steps alternating with non-DP
steps round by round, so that the machine's load drifts over all three alike (separate processes
on a shared VM can sit 10–20 % apart for a whole run). The order rotates from round to round: on a
loaded 2-core VM the private step run right after the non-DP one was ≈ 9 % slower than the one
after it, whichever tree it was (ResNet-18 at 64², 12 rounds each way).

    git worktree add /tmp/base <commit>
    python bench/investigate/host_ab.py --other /tmp/base --noise 0

Prints best and median milliseconds per step of ``nondp``, ``this`` and ``other``, and each
private step's median per-round ratio to non-DP. ``--model`` runs a real model instead of the
proxy (arithmetic included, torch's default threads), built as the clipping benchmark builds it
(timm or torchvision, BatchNorm replaced by GroupNorm), e.g. the CPU target's configuration, the two
engines measured against each other:

    python bench/investigate/host_ab.py --other /tmp/base --model vit_tiny_patch16_224 \\
        --rounds 12 --steps 1
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # this checkout (its private_engine is "this")
sys.path.insert(0, str(ROOT))
from bench.investigate.host_overhead import build_proxy, nondp_step, proxy_batch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", required=True, help="root of another private_engine checkout")
    p.add_argument("--mode", default="bk_mixed",
                   help="private_engine clipping mode (both checkouts)")
    p.add_argument("--noise", type=float, default=1.0,
                   help="noise multiplier σ (0: no noise draw)")
    p.add_argument("--width", type=int, default=64, help="the proxy's embed_dim")
    p.add_argument("--model", help="a model of the clipping benchmark (random init, 10 classes) "
                                    "instead of the proxy")
    p.add_argument("--img-size", type=int, default=224, help="with --model")
    p.add_argument("--batch-size", type=int, default=16, help="with --model")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=3, help="steps per method per round")
    return p.parse_args(argv)


def load_package(alias: str, root: Path):
    """``root/private_engine`` imported under the module name ``alias`` (its imports are
    relative)."""
    init = root / "private_engine" / "__init__.py"
    if not init.exists():
        raise SystemExit(f"{init} not found: --other must be the root of a private_engine "
                         "checkout")
    spec = importlib.util.spec_from_file_location(alias, init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    packages = {"this": load_package("_pe_this", ROOT),
                "other": load_package("_pe_other", Path(args.other))}
    if args.model:
        from bench.clipping import cli
        from bench.clipping.models import build_model

        bench_args = cli.parse_args(["--model", args.model, "--img-size", str(args.img_size),
                                     "--device", "cpu", "--methods", "nondp"])
        bench_args.model = args.model

        def build():  # as the clipping benchmark builds it: BatchNorm → GroupNorm
            return build_model(bench_args)[0]

        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=gen)
        y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    else:  # host cost only: one thread, tiny arithmetic
        torch.set_num_threads(1)

        def build():
            return build_proxy(width=args.width)

        x, y = proxy_batch()
    steps = {"nondp": nondp_step(build(), x, y)}
    for name, pe in packages.items():
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        pe.PrivacyEngine(model, batch_size=x.shape[0], sample_size=100 * x.shape[0],
                         max_grad_norm=1.0, noise_multiplier=args.noise,
                         clipping_mode=args.mode,
                         check_sampling=False).attach(opt)  # fixed batches: timing

        def dp(model=model, opt=opt):
            opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))
            opt.zero_grad(set_to_none=True)

        steps[name] = dp
    for step in steps.values():
        for _ in range(3):
            step()
    times = {k: [] for k in steps}
    names = list(steps)
    for r in range(args.rounds):
        # the order rotates: no private step always runs right after the non-DP one
        for name in names[r % len(names):] + names[:r % len(names)]:
            step = steps[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
    result = {k: (min(v), statistics.median(v)) for k, v in times.items()}
    print(f"{args.mode}, σ = {args.noise}: "
          + "  ".join(f"{k} best {b:.2f} ms, median {m:.2f} ms" for k, (b, m) in result.items()))
    ratios = {k: statistics.median(t / n for t, n in zip(times[k], times["nondp"]))
              for k in ("this", "other")}
    print("median per-round ratio to non-DP: "
          + "  ".join(f"{k} {r:.3f}×" for k, r in ratios.items()))
    return result


if __name__ == "__main__":
    main()
