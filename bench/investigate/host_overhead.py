"""Host-side cost of one private step, measured on the CPU: the layer structure of a real model at
tiny sizes (ViT-B/16's 12 blocks and 77 clipped layers, width 64, 16×16 images = 2 tokens,
batch 2, one thread), so that arithmetic is negligible and the time per step is Python, hooks and
operator dispatch — what keeps a GPU waiting when its kernels are fast (docs/engine.md, "CUDA").
Also counts the aten operators one step issues (each is a kernel launch on a GPU).

    python bench/investigate/host_overhead.py                       # bk_mixed vs non-DP
    python bench/investigate/host_overhead.py --mode bk --width 128
    python bench/investigate/host_overhead.py --width 768 --img-size 224 --batch-size 32 \
        --count-only        # kernels at a real step's shapes (ViT-B/16, 197 tokens, batch 32)
    python bench/investigate/host_overhead.py --width 768 --img-size 224 --batch-size 8 \
        --count-only --by-caller 30     # and the private step's kernels by engine function
    python bench/investigate/host_overhead.py --width 768 --img-size 224 --batch-size 8 \
        --count-only --by-caller 30 --ops 8 --cuda-choices   # with each function's aten ops, on
                                                             # the code path a CUDA device takes

Prints ``non-DP <ms>  <mode> <ms>  ratio <r>  aten ops/step <non-DP> -> <mode>  kernels/step
<non-DP> -> <mode>``: medians over ``--repeats`` rounds of ``--steps`` steps each, the two
trainings alternating round by round. "aten ops" counts every operator the profiler sees (views
and composite ops included: host work); "kernels" counts the operators that reach a backend with
data to compute — no views, no shape or allocation-only ops — i.e. about one kernel launch each on
a GPU.

The tiny shapes leave out what depends on size: at ViT-B/16's 197 tokens the stacked bound
arithmetic and the stacked operands are formed in chunks (``layers/ghost_stack.py``), each chunk
its own kernels. ``--img-size``, ``--batch-size`` and ``--count-only`` count the kernels of a step
at real shapes instead (no timing: a step there is arithmetic-bound on the CPU).

Kernels are counted on the CPU, where a few choices differ from a CUDA device's by a device
check: torch.optim's per-parameter loop (CUDA: one multi-tensor ``foreach`` update), the second
try by float64 Grams (``layers/gram.py``'s ``FLOAT64_SECOND_TRY``; CUDA: float32 Grams in blocks)
and those blocks added one by one (``ADDED_ONE_BY_ONE``), LayerNorm
gradients stacked only when small (``layers/norm_stack.py``'s ``CPU_LAYER_ELEMENTS``), kept
per-sample gradients grouped by their size per sample rather than in all (``clipping/kept.py``),
``|X|·v`` by an absolute value and a sum rather than one L1 reduction (``layers/gram.py``'s
``_abs_rows``). ``--cuda-choices`` counts with the CUDA choices instead (both trainings); what
else differs on a device (the noise's draw, 16-bit Gram paths, the convolution rule's CPU
paths) is left as the CPU runs it. The CPU noise is drawn on worker threads, whose operators are
not counted.
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
                   help="a timm model that takes embed_dim/num_heads")
    p.add_argument("--width", type=int, default=64, help="embed_dim (heads = width // 32)")
    p.add_argument("--mode", default="bk_mixed", help="private_engine clipping mode")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--img-size", type=int, default=16, help="image height = width (16: 2 tokens)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--count-only", action="store_true",
                   help="count aten ops and kernels per step only (no timing)")
    p.add_argument("--by-caller", type=int, default=0, metavar="N",
                   help="with --count-only: also print the private step's kernels by the N "
                        "private_engine functions that issue most of them")
    p.add_argument("--ops", type=int, default=0, metavar="K",
                   help="with --by-caller: each function's K most frequent aten operators")
    p.add_argument("--cuda-choices", action="store_true",
                   help="count on the code path a CUDA device takes where the CPU's differs by "
                        "a device check (module docstring)")
    return p.parse_args(argv)


@contextlib.contextmanager
def cuda_choices(*optimizers):
    """The device-dependent choices of the engine and of torch.optim set as on a CUDA device
    (module docstring) for the duration; ``optimizers``: their param groups get
    ``foreach=True`` (torch's default for CUDA parameters)."""
    from private_engine.clipping import kept
    from private_engine.layers import gram, norm_stack

    saved = (gram.ADDED_ONE_BY_ONE, gram.L1_IN_ONE_PASS, norm_stack.CPU_LAYER_ELEMENTS,
             kept.SMALL_BY_TOTAL, gram.FLOAT64_SECOND_TRY)
    groups = [g for opt in optimizers for g in opt.param_groups]
    foreach = [g.get("foreach") for g in groups]
    gram.ADDED_ONE_BY_ONE, norm_stack.CPU_LAYER_ELEMENTS = (), norm_stack.HELD_ELEMENTS
    gram.FLOAT64_SECOND_TRY = ()
    gram.L1_IN_ONE_PASS = kept.SMALL_BY_TOTAL = ("cuda", "cpu")
    for g in groups:
        g["foreach"] = True
    try:
        yield
    finally:
        (gram.ADDED_ONE_BY_ONE, gram.L1_IN_ONE_PASS, norm_stack.CPU_LAYER_ELEMENTS,
         kept.SMALL_BY_TOTAL, gram.FLOAT64_SECOND_TRY) = saved
        for g, f in zip(groups, foreach):
            g["foreach"] = f


def aten_ops_per_step(step) -> int:
    """aten operators one call of ``step`` dispatches (torch.profiler, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


#: operators that compute nothing on a device (views, metadata, allocation): not counted as kernels
NON_KERNEL_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "t", "transpose",
    "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "detach", "alias", "split",
    "split_with_sizes", "unbind", "narrow", "unflatten", "flatten", "lift_fresh", "empty",
    "empty_strided", "empty_like", "new_empty", "new_empty_strided", "promote_types",
    "result_type", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "set_"})


def kernels_per_step(step) -> int:
    """Operators one call of ``step`` sends to a backend with data to compute (``NON_KERNEL_OPS``
    left out): the kernel launches it would cost on a GPU, counted below autograd with a
    ``TorchDispatchMode``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = 0

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal count
            if func.overloadpacket.__name__ not in NON_KERNEL_OPS:
                count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return count


def kernels_by_caller(step, ops: bool = False) -> dict:
    """The kernels of one call of ``step`` (as :func:`kernels_per_step` counts them) by the
    innermost ``private_engine`` function on the Python stack when each was dispatched
    (``file:function``; the batch flow's dispatch mode skipped, so that a model's own operators
    count under the engine function that ran them, or ``-`` outside the engine); with ``ops``,
    by ``(function, aten operator)``."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    counts = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in NON_KERNEL_OPS:
                frame, site = sys._getframe(1), "-"
                while frame is not None:
                    name = frame.f_code.co_filename
                    if "private_engine/" in name and "batch_flow" not in name:
                        site = (f"{name.split('private_engine/')[-1]}:"
                                f"{frame.f_code.co_name}")
                        break
                    frame = frame.f_back
                counts[(site, func.overloadpacket.__name__) if ops else site] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return counts


def build_proxy(model: str = "vit_base_patch16_224", width: int = 64, img_size: int = 16):
    """The proxy model: ``model``'s structure at width ``width`` (heads = width // 32) for
    ``img_size``² images, seeded."""
    import timm
    import torch

    torch.manual_seed(0)
    return timm.create_model(model, img_size=img_size, num_classes=10, embed_dim=width,
                             num_heads=max(1, width // 32))


def proxy_batch(batch: int = 2, img_size: int = 16):
    """The proxy's batch: ``batch`` images of ``img_size``² (16: two tokens each with a class
    token) and their labels."""
    import torch

    return torch.randn(batch, 3, img_size, img_size), (torch.arange(batch) + 1) % 10


def nondp_step(model, x, y):
    """One non-private SGD step of ``model`` on ``(x, y)``, as a closure."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.optimizer = opt  # type: ignore[attr-defined]
    return step


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    import private_engine as pe
    from private_engine.guards.separability.probe import probed_at

    if not args.count_only:
        torch.set_num_threads(1)  # host cost: one thread, as one Python thread feeds a GPU

    def build():
        return build_proxy(args.model, args.width, args.img_size)

    x, y = proxy_batch(args.batch_size, args.img_size)
    nondp = nondp_step(build(), x, y)

    private = build()
    dp_opt = torch.optim.SGD(private.parameters(), lr=0.01)
    engine = pe.PrivacyEngine(private, batch_size=args.batch_size,
                              sample_size=50 * args.batch_size, max_grad_norm=1.0,
                              noise_multiplier=1.0, clipping_mode=args.mode,
                              check_sampling=False)  # fixed batches: timing only
    engine.attach(dp_opt)

    forwards = [0]

    def dp():
        forwards[0] += 1
        dp_opt.step(loss=F.cross_entropy(private(x), y, reduction="none"))
        dp_opt.zero_grad(set_to_none=True)

    def skip_probed():
        """Run, uncounted, the steps the separability probe runs on (its schedule probes forwards
        1, 4, 8, 16, … of an input signature) until the next one is an ordinary step."""
        while probed_at(forwards[0] + 1):
            dp()

    if args.cuda_choices:
        choices = cuda_choices(nondp.optimizer, dp_opt)
        choices.__enter__()
    for step in (nondp, dp):
        for _ in range(1 if args.count_only else 3):  # the first step runs the probes
            step()
    times: dict = {"nondp": [], "dp": []}
    for _ in range(0 if args.count_only else args.repeats):
        for name, step in (("nondp", nondp), ("dp", dp)):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - t0) / args.steps)
    result = {"nondp_ops": aten_ops_per_step(nondp), "nondp_kernels": kernels_per_step(nondp)}
    skip_probed()
    result["dp_ops"] = aten_ops_per_step(dp)
    skip_probed()
    result["dp_kernels"] = kernels_per_step(dp)
    counts = (f"aten ops/step {result['nondp_ops']} -> {result['dp_ops']}  "
              f"kernels/step {result['nondp_kernels']} -> {result['dp_kernels']}")
    if args.count_only:
        print(f"{args.mode}: {counts} "
              f"({result['dp_kernels'] / result['nondp_kernels']:.2f}×)")
        if args.by_caller:
            skip_probed()
            by_op = kernels_by_caller(dp, ops=True)
            sites: collections.Counter = collections.Counter()
            for (site, _), n in by_op.items():
                sites[site] += n
            for site, n in sites.most_common(args.by_caller):
                top = sorted(((c, op) for (s, op), c in by_op.items() if s == site),
                             reverse=True)[:args.ops]
                print(f"{n:6d}  {site}" + ("  " + " ".join(f"{op}:{c}" for c, op in top)
                                           if top else ""))
        if args.cuda_choices:
            choices.__exit__(None, None, None)
        return result
    if args.cuda_choices:
        choices.__exit__(None, None, None)
    result.update(nondp_ms=1e3 * statistics.median(times["nondp"]),
                  dp_ms=1e3 * statistics.median(times["dp"]))
    print(f"non-DP {result['nondp_ms']:.1f} ms  {args.mode} {result['dp_ms']:.1f} ms  "
          f"ratio {result['dp_ms'] / result['nondp_ms']:.2f}  {counts}")
    return result


if __name__ == "__main__":
    main()
