"""Throughput of a DP-MAE step against the same non-private MAE step, interleaved in one process.

The model is ``private_engine.pretrain.build_mae`` (a timm ViT encoder, 75 % of the patches
masked per sample, a ViT decoder): the non-private step is AdamW on the mean of the per-sample
losses, the private one DP-AdamW through the native engine (every parameter clipped per sample,
the mask token and position embeddings by the tracer, noise σ). Both see the same images and the
same masks; their steps alternate round by round, so that the load of a shared machine drifts
over both alike.

    python bench/investigate/mae_step.py
    python bench/investigate/mae_step.py --img-size 32 --patch-size 4 --depth 4 --batch-size 64 \\
        --rounds 10 --mode bk_mixed

Prints best and median milliseconds per step and samples per second of each, and the median
per-round time ratio private / non-private.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--decoder-dim", type=int, default=128)
    p.add_argument("--decoder-depth", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--mode", default="bk_mixed", help="private_engine clipping mode")
    p.add_argument("--noise", type=float, default=1.0, help="noise multiplier σ")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    import private_engine as pe
    from private_engine.pretrain import build_mae

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    def build():
        torch.manual_seed(0)
        return build_mae(args.model, img_size=args.img_size, patch_size=args.patch_size,
                         depth=args.depth, decoder_dim=args.decoder_dim,
                         decoder_depth=args.decoder_depth).to(device)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=gen).to(device)
    nondp_model, dp_model = build(), build()
    ids = nondp_model.shuffle_ids(torch.rand(args.batch_size, nondp_model.num_patches,
                                             generator=gen)).to(device)
    nondp_opt = torch.optim.AdamW(nondp_model.parameters(), lr=1e-4)
    engine = pe.PrivacyEngine(dp_model, batch_size=args.batch_size,
                              sample_size=100 * args.batch_size, max_grad_norm=0.1,
                              noise_multiplier=args.noise, clipping_mode=args.mode,
                              check_sampling=False)  # fixed batches: timing only
    dp_opt = pe.optim.DPAdamW(dp_model.parameters(), lr=1e-4, privacy_engine=engine)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def nondp():
        loss = nondp_model(x, ids_shuffle=ids).mean()
        nondp_opt.zero_grad(set_to_none=True)
        loss.backward()
        nondp_opt.step()

    def dp():
        dp_opt.step(loss=dp_model(x, ids_shuffle=ids))
        dp_opt.zero_grad(set_to_none=True)

    steps = {"nondp": nondp, "dp": dp}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    sync()
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            sync()
            times[name].append(1e3 * (time.perf_counter() - t0))
    result = {k: {"best_ms": min(v), "median_ms": statistics.median(v),
                  "samples_per_s": 1e3 * args.batch_size / statistics.median(v)}
              for k, v in times.items()}
    ratio = statistics.median(d / n for d, n in zip(times["dp"], times["nondp"]))
    result["ratio"] = ratio
    n_params = sum(p.numel() for p in dp_model.parameters())
    print(f"MAE on {args.model}: {args.depth} blocks, {args.img_size}px, patch {args.patch_size}, "
          f"decoder {args.decoder_depth}×{args.decoder_dim}, {n_params:,} parameters, batch "
          f"{args.batch_size}, {args.mode}, σ = {args.noise}, {torch.get_num_threads()} threads")
    for k in ("nondp", "dp"):
        r = result[k]
        print(f"{k:>6}: best {r['best_ms']:.1f} ms, median {r['median_ms']:.1f} ms, "
              f"{r['samples_per_s']:.1f} samples/s")
    print(f"median per-round ratio DP / non-DP: {ratio:.2f}×")
    return result


if __name__ == "__main__":
    main()
