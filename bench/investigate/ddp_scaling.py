"""Throughput of data-parallel private training with 1 and W processes, against non-private DDP
measured in the same processes (interleaved step by step, so the machine's load drifts over both
alike).

Each world size runs in its own ``torch.multiprocessing.spawn`` group (gloo on the CPU, NCCL with
``--device cuda`` and one GPU per process). The global batch B is fixed; each rank takes B/W
samples. Non-private: ``torch.nn.parallel.DistributedDataParallel`` with a mean loss, one
``backward`` and the optimizer's step. Private: the native engine (``distributed`` detected),
``optimizer.step(loss=per_sample_losses)`` — clipping on each rank, one all-reduce of the flat
clipped sums, noise once on rank 0.

With ``--fsdp`` both models are sharded by FSDP2 (``fully_shard`` on every transformer block,
then on the root): non-private FSDP2 (mean loss, ``backward``, FSDP2's reduce-scatter, the
optimizer's step on the shards) against the engine on the sharded model (one all-gather of the
model per step, clipping on each rank, one reduce-scatter of the clipped sums, each rank noising
its own rows; :mod:`private_engine.optim.sharded`).

    python bench/investigate/ddp_scaling.py --world-sizes 1 2 --model vit_tiny_patch16_224 \\
        --img-size 32 --batch-size 32 --steps 8 [--fsdp]

Prints, per world size, samples per second of both and the private/non-private time ratio.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", default="vit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--steps", type=int, default=8, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mode", default="bk_mixed", help="clipping mode")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fsdp", action="store_true",
                   help="shard both models with FSDP2 (fully_shard) instead of DDP")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(args):
    import timm

    torch.manual_seed(0)
    return timm.create_model(args.model, img_size=args.img_size, patch_size=args.patch_size,
                             num_classes=10)


def _shard(model):
    """FSDP2: ``fully_shard`` on every block (``blocks`` of a timm ViT), then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(model, "blocks", []):
        fully_shard(block)
    fully_shard(model)
    return model


def _worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    import private_engine as pe

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    local = args.batch_size // world
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(local, 3, args.img_size, args.img_size, generator=gen).to(device)
    y = torch.randint(0, 10, (local,), generator=gen).to(device)

    plain = _build(args).to(device)
    ddp = _shard(plain) if args.fsdp else torch.nn.parallel.DistributedDataParallel(plain)
    plain_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    model = _build(args).to(device)
    if args.fsdp:
        model = _shard(model)
    engine = pe.PrivacyEngine(model, batch_size=args.batch_size,
                              sample_size=100 * args.batch_size, max_grad_norm=1.0,
                              noise_multiplier=1.0, clipping_mode=args.mode,
                              check_sampling=False)  # fixed batches: timing only
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.01))

    def nondp_step():
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        plain_opt.step()

    def private_step():
        opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))

    def timed(step) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        timed(nondp_step)
        timed(private_step)
    times = {"nondp": [], "private": []}
    for _ in range(args.steps):
        times["nondp"].append(timed(nondp_step))
        times["private"].append(timed(private_step))
    if rank == 0:
        torch.save(times, os.path.join(out_dir, f"world{world}.pt"))
    dist.destroy_process_group()


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = {}
    base_name = "FSDP2" if args.fsdp else "DDP"
    with tempfile.TemporaryDirectory() as out_dir:
        for world in args.world_sizes:
            mp.spawn(_worker, args=(world, _free_port(), args, out_dir), nprocs=world, join=True)
            times = torch.load(os.path.join(out_dir, f"world{world}.pt"))
            nondp = statistics.median(times["nondp"])
            private = statistics.median(times["private"])
            results[world] = dict(nondp=nondp, private=private)
            print(f"world {world} ({base_name}): non-DP {args.batch_size / nondp:8.1f} samples/s, "
                  f"private ({args.mode}) {args.batch_size / private:8.1f} samples/s, "
                  f"private/non-DP time {private / nondp:.2f}×")
    base = results.get(min(results))
    for world, r in results.items():
        if base is not None and world != min(results):
            print(f"scaling {min(results)}→{world} processes: non-DP "
                  f"{base['nondp'] / r['nondp']:.2f}×, "
                  f"private {base['private'] / r['private']:.2f}×")
    return results


if __name__ == "__main__":
    main()
