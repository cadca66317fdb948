"""Tied input/output embeddings (a GPT-2-style language model): time and memory of a private step
whose tied vocabulary matrix is normed by the joint ghost norm ("bk_mixed") or by instantiated,
summed per-sample gradients ("bk_mixopt", whose time rule instantiates them when the sequence is
long against the width, ``2·T²·(d + V) ≥ 32·V·d``), against non-private training and Opacus.

The model: token and position embeddings (``V×d``), ``--layers`` residual MLP blocks, and an output
projection tied to the token embedding. Times are interleaved round by round in one process (the
machine's load drifts over every method alike); the peak resident memory of one step is measured
per method in a fresh subprocess (resident memory sampled every millisecond during two steps,
minus what the process held after building the model and batch).

    python bench/investigate/tied_lm.py --vocab 8192 --dim 128 --seq 64 --batch-size 8
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

METHODS = ("nondp", "bk_mixed", "bk_mixopt", "opacus")


class TiedLM(nn.Module):
    """Embeddings, residual MLP blocks, and ``lm_head.weight is wte.weight``."""

    def __init__(self, vocab: int, dim: int, seq: int, layers: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim),
                                                  nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        h = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(self.ln_f(h))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--memory-of", choices=METHODS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def per_sample_loss(model, ids):
    """Next-token cross-entropy summed over positions, one value per sample."""
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def build(method: str, args):
    """``(step function, engine or None)`` of one method on a fresh model (no step taken)."""
    torch.manual_seed(0)
    model = TiedLM(args.vocab, args.dim, args.seq, args.layers)
    B = args.batch_size
    ids = torch.randint(0, args.vocab, (B, args.seq), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if method == "nondp":
        def step():
            per_sample_loss(model, ids).mean().backward()
            opt.step()
            opt.zero_grad()
        return step, None
    if method == "opacus":
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(ids), batch_size=B)
        module, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False)

        def step():
            per_sample_loss(module, ids).mean().backward()
            opt.step()
            opt.zero_grad()
        return step, None
    import private_engine as pe
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=100 * B, max_grad_norm=1.0,
                              noise_multiplier=1.0, clipping_mode=method,
                              check_sampling=False)  # fixed batches: timing only
    engine.attach(opt)

    def step():
        opt.step(loss=per_sample_loss(model, ids))
        opt.zero_grad()
    return step, engine


def tied_note(engine) -> str:
    """How the engine normed the tied weight at its last step."""
    if engine is None:
        return ""
    tied = [d for d in engine.layer_plan if d.name in ("wte", "lm_head")]
    return "joint ghost" if all(d.use_ghost for d in tied) else "instantiated"


def _rss_mib() -> float:
    """Resident memory of this process now (Linux ``/proc/self/statm``), MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2 ** 20


def peak_memory(method: str, args) -> float:
    """MiB of resident memory two steps add at their peak over what the process held before
    them, sampled every millisecond by a thread (run in a fresh process: call it there)."""
    import threading

    step, _ = build(method, args)
    before = _rss_mib()
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        step()
        step()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _rss_mib()) - before


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.memory_of:
        print(json.dumps({"peak_mib": peak_memory(args.memory_of, args)}))
        return {}
    steps, engines, times = {}, {}, {m: [] for m in args.methods}
    for m in args.methods:
        steps[m], engines[m] = build(m, args)
        steps[m]()  # warm-up
    for _ in range(args.rounds):
        for m in args.methods:
            t = time.perf_counter()
            steps[m]()
            times[m].append(time.perf_counter() - t)
    base = statistics.median(times["nondp"]) if "nondp" in times else None
    result = {}
    forward = list(argv if argv is not None else sys.argv[1:])
    for m in args.methods:
        cmd = [sys.executable, __file__, *forward, "--memory-of", m]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        mem = json.loads(out.strip().splitlines()[-1])["peak_mib"]
        med = statistics.median(times[m])
        result[m] = {"ms": 1e3 * med, "ratio": med / base if base else None, "peak_mib": mem,
                     "tied": tied_note(engines[m])}
    print(f"V={args.vocab} d={args.dim} T={args.seq} layers={args.layers} B={args.batch_size}, "
          f"{args.rounds} rounds, {torch.get_num_threads()} threads")
    print("| method | tied weight | ms/step | × non-DP | peak MiB of a step |")
    print("| --- | --- | --- | --- | --- |")
    for m, r in result.items():
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "—"
        print(f"| {m} | {r['tied'] or '—'} | {r['ms']:.0f} | {ratio} | {r['peak_mib']:.0f} |")
    return result


if __name__ == "__main__":
    main()
