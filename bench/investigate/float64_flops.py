"""Matmul FLOPs of one private step split by dtype, and the step's time, on the CPU: ViT-B/16's
structure (12 blocks, width 768, 16×16 patches) on ``--img-size`` images, float32 (or
``--amp bf16``: the forward and backward under CPU autocast to bfloat16).

On a GPU float64 matmuls run at 1/15 to 1/64 of the float32 rate, so the float64 share of a
step's matmul FLOPs says how much of it leaves the fast path. Counted below autograd with a
``TorchDispatchMode``: every ``mm``, ``bmm``, ``addmm``, ``baddbmm``, convolution and attention
kernel, at torch's own FLOP formulas (``torch.utils.flop_counter``), attributed to the dtype of
its first operand.

    python bench/investigate/float64_flops.py --mode bk
    python bench/investigate/float64_flops.py --mode bk_mixed --img-size 64 --steps 3

Prints ``<mode> <dtype>: matmul GFLOP/step float64 <x> float32 <y> …  float64 share <s>  step
<ms> ms`` (the time a median over ``--steps`` steps after one warm-up step).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_base_patch16_224",
                   help="a timm model that takes embed_dim/num_heads/img_size")
    p.add_argument("--width", type=int, default=768, help="embed_dim (heads = width // 64)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--mode", default="bk", help="private_engine clipping mode")
    p.add_argument("--amp", choices=["none", "bf16"], default="none")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


class MatmulFlops:
    """A ``TorchDispatchMode`` factory: ``with counter.mode(): …`` adds every matmul-like kernel's
    FLOPs (``torch.utils.flop_counter.flop_registry``) to ``counter.by_dtype[dtype]``."""

    def __init__(self):
        self.by_dtype = collections.Counter()

    def mode(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        by_dtype = self.by_dtype

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                count = flop_registry.get(func.overloadpacket)
                if count is not None:
                    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                    dtype = first.dtype if first is not None else None
                    by_dtype[dtype] += count(*args, **kwargs, out_val=out)
                return out

        return Count()

    def share(self, dtype) -> float:
        """Fraction of the counted FLOPs whose first operand has ``dtype``."""
        total = sum(self.by_dtype.values())
        return self.by_dtype[dtype] / total if total else 0.0


def main(argv=None) -> dict:
    args = parse_args(argv)
    import timm
    import torch
    import torch.nn.functional as F

    import private_engine as pe

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = timm.create_model(args.model, img_size=args.img_size, num_classes=10,
                              embed_dim=args.width, num_heads=max(1, args.width // 64))
    B = args.batch_size
    x, y = torch.randn(B, 3, args.img_size, args.img_size), torch.arange(B) % 10
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=100 * B, max_grad_norm=1.0,
                              noise_multiplier=1.0, clipping_mode=args.mode,
                              check_sampling=False)  # fixed batches: measurement only
    engine.attach(opt)

    def autocast():
        if args.amp == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step():
        with autocast():
            loss = F.cross_entropy(model(x), y, reduction="none")
        opt.step(loss=loss.float())
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    counter = MatmulFlops()
    with counter.mode():
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    share = counter.share(torch.float64)
    parts = "  ".join(f"{str(k).replace('torch.', '')} {v / 1e9:.2f}"
                      for k, v in sorted(counter.by_dtype.items(), key=lambda kv: -kv[1]))
    print(f"{args.mode} {args.amp}: matmul GFLOP/step {parts}  float64 share {share:.4f}  "
          f"step {ms:.0f} ms")
    return {"float64_share": share, "step_ms": ms,
            "gflop": {str(k): v / 1e9 for k, v in counter.by_dtype.items()}}


if __name__ == "__main__":
    main()
