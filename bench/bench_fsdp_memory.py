#!/usr/bin/env python
"""Peak memory per rank of training an FSDP2-sharded MLP on 2 gloo CPU processes: non-private
FSDP2 against the private engine (``--mode``, default "bk_mixed").

The model is ``--layers`` Linear layers of width ``--width`` (ReLU between), ``fully_shard`` on
each layer and on the root. Each rank runs ``--steps`` optimizer steps (SGD) of ``--batch``
samples per rank and ``--accumulate`` physical batches per step.

What is measured: the peak resident set size of each rank's process (Linux ``VmHWM``) during the
steps after the first (the first builds FSDP2's and the engine's lazy state), minus its resident
size just before them — the physical memory the training steps added at their peak. The peak is
reset by writing 5 to ``/proc/self/clear_refs`` before the measured steps. The ranks run with
``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor above 64 KiB is its own ``mmap`` that the C
library returns to the system when freed: the resident size follows the live tensors instead of
the C library's free lists. Linux only.

    python bench/bench_fsdp_memory.py --layers 8 --width 1024 --batch 32
"""
import argparse
import os
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 2
MiB = 2 ** 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _rank(rank: int, port: int, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=300))
    from torch.distributed.fsdp import fully_shard

    import private_engine as pe

    model = _model(args.layers, args.width)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = None
    if args.mode != "none":
        B = args.batch * args.accumulate * WORLD
        engine = pe.PrivacyEngine(model, batch_size=B, sample_size=100 * B, max_grad_norm=1.0,
                                  noise_multiplier=1.0, clipping_mode=args.mode,
                                  check_sampling=False)
        optimizer = engine.attach(optimizer)
    g = torch.Generator().manual_seed(rank)
    before = 0
    for step in range(args.steps):
        if step == 1:
            before = _status_kib("VmRSS")
            _reset_peak()
        for k in range(args.accumulate):
            x = torch.randn(args.batch, args.width, generator=g)
            y = torch.randint(0, args.width, (args.batch,), generator=g)
            loss = F.cross_entropy(model(x), y, reduction="none")
            if engine is None:
                if args.accumulate > 1:
                    model.set_requires_gradient_sync(k == args.accumulate - 1)
                loss.mean().backward()
            elif k < args.accumulate - 1:
                optimizer.virtual_step(loss)
            else:
                optimizer.step(loss)
        if engine is None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = _status_kib("VmHWM")
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{peak - before} {peak} {before}\n")
    dist.barrier()
    dist.destroy_process_group()


def measure(args) -> list:
    """``[(added peak KiB, peak KiB, resident KiB before), ...]`` per rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(port, args, out), nprocs=WORLD, start_method="spawn")
        rows = []
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.txt")) as f:
                rows.append(tuple(int(v) for v in f.read().split()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and batch")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", nargs="+", default=["none", "bk_mixed"],
                        help='"none" (non-private FSDP2) and/or clipping modes')
    args = parser.parse_args()
    params = args.layers * (args.width ** 2 + args.width)
    print(f"MLP {args.layers}×{args.width}: {params / 1e6:.1f} M parameters, replica "
          f"{params * 4 / MiB:.1f} MiB (float32); {WORLD} gloo ranks, {args.batch} samples per "
          f"rank and batch, {args.accumulate} batch(es) per step")
    print("mode       rank  peak added by the steps (MiB)  peak RSS (MiB)")
    for mode in args.mode:
        one = argparse.Namespace(**{**vars(args), "mode": mode})
        for r, (added, peak, _) in enumerate(measure(one)):
            print(f"{mode:10s} {r:4d}  {added / 1024:29.1f}  {peak / 1024:14.1f}")


if __name__ == "__main__":
    main()
