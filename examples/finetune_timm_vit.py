#!/usr/bin/env python
"""Private training or fine-tuning of a timm model (`make demo`): Poisson sampling, DP-Adam,
book-keeping clipping.

Default (`make demo`): ``vit_tiny_patch16_224`` (width 192, 3 heads) built for the 8×8 digits
with 2×2 patches (16 tokens), 4 blocks and average pooling, trained from scratch on
scikit-learn's embedded digits (no download), automatic clipping, ε = 8.

Any timm model name works (torchvision names too); BatchNorm models (ResNets, EfficientNets, …)
get BatchNorm → GroupNorm by ``private_engine.fix_batchnorm``. Data: ``--data digits``
(embedded), ``--data folder --data-dir DIR`` (an ImageFolder),
``--data cifar10|cifar100 --data-dir DIR`` (torchvision's files already on disk; never
downloaded). Images are resized to the model's input size and normalised with its mean/std
(``--img-size`` overrides the size). The small-ViT preset (8×8, 2×2 patches, 4 blocks, average
pooling) applies to ``--data digits`` without ``--pretrained``; otherwise the model keeps its own
architecture. ``--pretrained`` loads the hub weights (network needed; off by default). Every
trainable parameter is trained, with its per-sample gradient clipped: trainable parameters that
no layer rule covers (class tokens, position embeddings, LayerScale gammas, bias tables, …) are
clipped by the engine's parameter-entry tracer and listed; modules that only the torch.func
fallback handles are clipped by it (it warns, naming them). ``--seed`` seeds the model's
initialisation and the train/test split only: the noise and the Poisson sampler draw from
generators seeded from OS entropy (``private_engine.optim.noise``), so no two runs add the same
noise or sample the same batches — a public seed for either would let anyone re-run the script
on a neighbouring dataset and subtract the noise, or learn the batches (privacy amplification by
subsampling needs them secret). ``--amp``: bfloat16 autocast (``--amp fp16``: float16 with a
GradScaler). ``--tensorboard DIR``: a TensorBoard log of every step's ε, loss, clip fraction and
dropped samples (the last three are non-private statistics of the batch; docs/engine.md,
"Logging and monitoring"). The last line reads ``ε=… δ=… σ=… accuracy=… seconds=…``.

Examples::

    python examples/finetune_timm_vit.py                              # the demo, ~100 s on 2 cores
    python examples/finetune_timm_vit.py --model resnet18 --epochs 5  # BatchNorm → GroupNorm
    python examples/finetune_timm_vit.py --data folder --data-dir ~/flowers --pretrained --epsilon 3
    python examples/finetune_timm_vit.py --data cifar10 --data-dir ~/data --pretrained --amp \\
        --device cuda
    torchrun --standalone --nproc_per_node=2 examples/finetune_timm_vit.py --device cpu

Under ``torchrun`` every process trains on its share of each Poisson batch; the engine sums the
clipped gradients across processes and adds the noise once; rank 0 logs (docs/distributed.md).
"""
from __future__ import annotations

import argparse
import builtins
import contextlib
import os
import sys
import time
from typing import Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

import private_engine as pe
from private_engine.data import poisson_loader
from private_engine.demo.image_data import SOURCES, load_image_data, model_data_config, num_classes
from private_engine.demo.models import create_model
from private_engine.foundation.randomness import entropy_seeded_generator
from private_engine.guards.model_check import batchnorm_modules, traced_parameters
from private_engine.training import accuracy, private_logical_step

VIT_PREFIXES = ("vit_", "deit_", "deit3_")
#: the demo's small ViT for the 8×8 digits (``--data digits`` without ``--pretrained``)
DIGITS_PRESET = dict(img_size=8, patch_size=2, depth=4, global_pool="avg")
#: CNNs on the digits: upsampled to 32×32 so that a few stride-2 stages fit
DIGITS_CNN_SIZE = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_tiny_patch16_224",
                   help="timm (or torchvision) model name")
    p.add_argument("--pretrained", action="store_true",
                   help="load pretrained weights from the hub (network needed); the classifier "
                        "is new")
    p.add_argument("--data", default="digits", choices=SOURCES,
                   help="digits: embedded; folder: an ImageFolder at --data-dir; "
                        "cifar10/cifar100: torchvision's files under --data-dir (never "
                        "downloaded)")
    p.add_argument("--data-dir", help="folder of --data folder / cifar10 / cifar100")
    p.add_argument("--subset", type=int,
                   help="train on the first N training examples only (smoke runs; n = N)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--img-size", type=int,
                   help="input height = width (default: the model's; 8 in the digits preset)")
    p.add_argument("--patch-size", type=int,
                   help="ViT patch size (default: the model's; 2 in the digits preset)")
    p.add_argument("--depth", type=int,
                   help="ViT blocks (default: the model's; 4 in the digits preset)")
    p.add_argument("--global-pool", choices=["avg", "token"],
                   help="ViT head input: mean of patch tokens (built without cls_token unless "
                        "--pretrained) or the cls token (default: the model's; avg in the "
                        "digits preset)")
    p.add_argument("--epsilon", type=float, default=8.0,
                   help="target ε (σ is calibrated to spend it)")
    p.add_argument("--delta", type=float, default=None, help="default 1/(2n)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=256,
                   help="logical (expected) batch size of Poisson sampling")
    p.add_argument("--physical-batch-size", type=int, default=128,
                   help="samples per forward/backward (memory)")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--clipping-mode", default="bk_mixed", choices=list(pe.CLIPPING_MODES),
                   help="bk_mixed (default): one backward, book-keeping "
                        "(docs/engine.md, 'Clipping modes')")
    p.add_argument("--clipping-fn", default="automatic",
                   choices=["abadi", "automatic", "global"])
    p.add_argument("--accountant", default="rdp", choices=["rdp", "prv", "gdp", "pld"])
    p.add_argument("--amp", nargs="?", const="bf16", choices=("bf16", "fp16"),
                   help="autocast: bf16 (the default of a bare --amp; CPU, or CUDA GPUs with "
                        "bfloat16) or fp16 (float16 with a torch.amp.GradScaler; needs a "
                        "book-keeping --clipping-mode)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model initialisation and the train/test split; never the "
                        "noise or the Poisson sampling, which draw from OS entropy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write every step's ε, loss, clip fraction and dropped samples to a "
                   "TensorBoard log in DIR (needs the tensorboard package)")
    args = p.parse_args(argv)
    if args.data != "digits" and not args.data_dir:
        p.error(f"--data {args.data} needs --data-dir DIR")
    return resolve_defaults(args)


def is_vit(name: str) -> bool:
    return name.startswith(VIT_PREFIXES)


def resolve_defaults(args):
    """Fill unset architecture options: the digits preset (ViT: 8×8, patch 2, depth 4, avg pool;
    CNN: 32×32) for ``--data digits`` without ``--pretrained``, otherwise the model's own."""
    args.preset = args.data == "digits" and not args.pretrained
    if args.preset:
        if is_vit(args.model):
            for key, value in DIGITS_PRESET.items():
                if getattr(args, key) is None:
                    setattr(args, key, value)
        elif args.img_size is None:
            args.img_size = DIGITS_CNN_SIZE
    return args


def autocast(args):
    """The ``--amp`` context: bfloat16 (or float16) autocast on CPU or CUDA; a no-op without
    ``--amp``.

    bfloat16 keeps float32's exponent range, so no loss scaling is needed: the rules run their
    matmuls in bfloat16 and accumulate every norm and the clipped sum in float32 (about 3
    significant digits; tests/examples/test_example_finetune.py checks this against the float64
    reference). float16 needs a loss scaler: :func:`grad_scaler` gives the engine one
    (private_engine/clipping/loss_scaling.py).
    """
    if not args.amp:
        return contextlib.nullcontext()
    device_type = torch.device(args.device).type
    if device_type not in ("cpu", "cuda"):
        raise SystemExit(f"--amp supports cpu and cuda, not {device_type}")
    if args.amp == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise SystemExit("--amp bf16: this GPU does not support bfloat16; use --amp fp16 "
                         "(float16 with loss scaling).")
    if args.amp == "fp16" and not args.clipping_mode.startswith("bk"):
        raise SystemExit("--amp fp16 needs a book-keeping --clipping-mode (bk, bk_mixed, "
                         f"bk_mixopt), not {args.clipping_mode}: an overflowing sample is then "
                         "dropped alone.")
    return torch.autocast(device_type,
                          dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16)


def grad_scaler(args):
    """A ``torch.amp.GradScaler`` for ``--amp fp16`` (the engine scales, unscales and drops
    overflows), else None."""
    if args.amp != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(args.device).type)


def build_model(args, num_classes: int) -> torch.nn.Module:
    """The model to train: timm/torchvision by name, BatchNorm → GroupNorm; the trainable
    parameters no layer rule covers are listed (the parameter-entry tracer clips them)."""
    kwargs = dict(pretrained=args.pretrained, num_classes=num_classes)
    if is_vit(args.model):
        for key in ("img_size", "patch_size", "depth"):
            if getattr(args, key) is not None:
                kwargs[key] = getattr(args, key)
        if args.global_pool == "avg":
            kwargs["global_pool"] = "avg"
            # no cls_token at all (a pretrained checkpoint has one: it stays, unpooled)
            if not args.pretrained:
                kwargs["class_token"] = False
        elif args.global_pool == "token":
            kwargs.update(class_token=True, global_pool="token")
    model = create_model(args.model, **kwargs)
    bns = batchnorm_modules(model)
    if bns:
        # BatchNorm mixes the samples of a batch: no per-sample gradient exists. The one-call fix:
        model = pe.fix_batchnorm(model)
        print(f"BatchNorm → GroupNorm (private_engine.fix_batchnorm): {len(bns)} layers")
    # Every trainable parameter is clipped: layer rules, the parameter-entry tracer (tokens,
    # pos_embed, LayerScale, bias tables) or the torch.func fallback (which warns, naming its
    # modules).
    traced = traced_parameters(model)
    if traced:
        print(f"clipped by the parameter-entry tracer: {', '.join(traced[:6])}"
              + (" …" if len(traced) > 6 else ""))
    return model


def setup_distributed(args) -> Tuple[int, torch.device]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the process group — NCCL on CUDA, one GPU
    per process (``LOCAL_RANK``), gloo on the CPU — and return ``(rank, device)``; otherwise
    ``(0, --device)``. Every rank builds the same model (same ``--seed``); the engine sums the
    clipped gradients across ranks and adds the noise once (docs/distributed.md)."""
    device = torch.device(args.device)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, device
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), device


def step_log(args, engine):
    """``--tensorboard DIR``: a ``SummaryWriter`` on DIR that the engine sends every step's
    metrics to (None without the option)."""
    if not args.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(args.tensorboard)
    engine.add_step_logger(writer)
    return writer


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rank, device = setup_distributed(args)
    print = builtins.print if rank == 0 else (lambda *a, **k: None)  # noqa: A001 (rank 0 logs)
    amp = autocast(args)  # refuses unsupported settings before anything is built

    model = build_model(args, num_classes(args.data, args.data_dir))
    config = model_data_config(model, args.img_size)  # input size, mean, std of the model
    train, test, classes = load_image_data(args.data, config, args.data_dir, args.seed)
    if args.subset is not None:
        train = Subset(train, range(min(args.subset, len(train))))
    model = model.to(device)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # secret batch membership: the sampler's generator comes from OS entropy, not from --seed
    loader = poisson_loader(train, args.batch_size, generator=entropy_seeded_generator(),
                            num_workers=args.workers)
    engine = pe.PrivacyEngine(
        model, batch_size=args.batch_size, sample_size=len(train), steps=args.epochs * len(loader),
        max_grad_norm=args.max_grad_norm, target_epsilon=args.epsilon, target_delta=args.delta,
        clipping_mode=args.clipping_mode, clipping_fn=args.clipping_fn, accountant=args.accountant,
        grad_scaler=grad_scaler(args),
    )
    writer = step_log(args, engine) if rank == 0 else None
    optimizer = pe.optim.DPAdam(model.parameters(), lr=args.lr, privacy_engine=engine)
    test_loader = DataLoader(test, batch_size=args.physical_batch_size, num_workers=args.workers)
    _, h, w = config["input_size"]
    amp_note = {"bf16": ", bfloat16 autocast",
                "fp16": ", float16 autocast + GradScaler"}.get(args.amp, "")
    print(f"{args.model}{' (pretrained)' if args.pretrained else ''} at {h}×{w}: "
          f"{n_trainable:,} trainable parameters; data {args.data} ({len(classes)} classes), "
          f"n={len(train)}, test {len(test)}; B={args.batch_size} "
          f"(physical {args.physical_batch_size}), σ={engine.noise_multiplier:.4f}, "
          f"R={args.max_grad_norm}, mode={args.clipping_mode}, clipping={args.clipping_fn}"
          f"{amp_note}")

    def per_sample_loss(xb, yb):
        with amp:
            return F.cross_entropy(model(xb), yb, reduction="none")

    start = time.perf_counter()
    acc = None
    model.train()
    for epoch in range(1, args.epochs + 1):
        bar = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", leave=False,
                   disable=rank != 0)
        for x, y in bar:
            loss = private_logical_step(optimizer, (x, y), per_sample_loss,
                                        args.physical_batch_size, device=device)
            bar.set_postfix(loss=f"{loss:.3f}", eps=f"{engine.get_epsilon():.2f}")
        with amp:
            acc = accuracy(model, test_loader, device)
        print(f"epoch {epoch}: test accuracy {acc:.3f}, ε = {engine.get_epsilon():.3f}")
    if acc is None:  # --epochs 0
        with amp:
            acc = accuracy(model, test_loader, device)
    seconds = time.perf_counter() - start
    if writer is not None:
        writer.close()
    print(f"ε={engine.get_epsilon():.3f} δ={engine.target_delta:.2e} "
          f"σ={engine.noise_multiplier:.4f} accuracy={acc:.3f} seconds={seconds:.1f}")
    return acc


def cli(argv=None):
    """``main`` for the command line: missing data ends with its message (exit status 1), no
    traceback."""
    try:
        main(argv)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    cli()
