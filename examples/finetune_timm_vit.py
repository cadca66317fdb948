#!/usr/bin/env python
"""Private training of a timm Vision Transformer — the project's main job (`make demo`).

Default: ``vit_tiny_patch16_224`` (width 192, 3 heads) built for the 8×8 digits with 2×2 patches
(16 tokens), 4 blocks and average pooling, trained from scratch with DP-Adam on scikit-learn's
embedded digits (no download), Poisson sampling, mixed ghost clipping, automatic clipping.
Prints ε spent, the noise multiplier and test accuracy. ``--pretrained`` loads real hub weights
(off by default; needs network access).
"""
from __future__ import annotations

import argparse
import time

import timm
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

import private_engine as pe
from private_engine.data import load_digits_images, poisson_loader
from private_engine.training import accuracy, private_logical_step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_tiny_patch16_224", help="timm model name")
    p.add_argument("--pretrained", action="store_true", help="load pretrained weights from the hub (network)")
    p.add_argument("--img-size", type=int, default=8, help="images are resized to this size")
    p.add_argument("--patch-size", type=int, default=2, help="ViT patch size (ViT-family models only)")
    p.add_argument("--depth", type=int, default=4, help="ViT blocks (ViT-family models only; 0 keeps the model's)")
    p.add_argument("--global-pool", default="avg", choices=["avg", "token"],
                   help="ViT head input: mean of patch tokens (no cls_token) or the cls token")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=None, help="default 1/(2n)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=256, help="logical (expected) batch size")
    p.add_argument("--physical-batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--clipping-mode", default="mixed", choices=["mixed", "ghost", "per_sample"])
    p.add_argument("--clipping-fn", default="automatic", choices=["abadi", "automatic", "global"])
    p.add_argument("--accountant", default="rdp", choices=["rdp", "prv", "gdp"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def build_model(args) -> torch.nn.Module:
    kwargs = dict(pretrained=args.pretrained, num_classes=10)
    if args.model.startswith(("vit_", "deit_")):
        kwargs.update(img_size=args.img_size, patch_size=args.patch_size)
        if args.depth:
            kwargs["depth"] = args.depth
        if args.global_pool == "avg":
            kwargs.update(class_token=False, global_pool="avg")
    model = timm.create_model(args.model, **kwargs)
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        model = pe.fix_batchnorm(model)
    # cls_token / pos_embed have no per-sample rule in this release: freeze them explicitly.
    frozen = [n for n, prm in model.named_parameters(recurse=False) if n in ("cls_token", "pos_embed", "dist_token", "reg_token")]
    for n in frozen:
        getattr(model, n).requires_grad_(False)
    if frozen:
        print(f"frozen (no per-sample rule yet): {', '.join(frozen)}")
    return model


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    device = torch.device(args.device)
    train, test = load_digits_images(image_size=args.img_size, channels=3, seed=args.seed)
    model = build_model(args).to(device)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    loader = poisson_loader(train, args.batch_size, generator=torch.Generator().manual_seed(args.seed))
    engine = pe.PrivacyEngine(
        model, batch_size=args.batch_size, sample_size=len(train), steps=args.epochs * len(loader),
        max_grad_norm=args.max_grad_norm, target_epsilon=args.epsilon, target_delta=args.delta,
        clipping_mode=args.clipping_mode, clipping_fn=args.clipping_fn, accountant=args.accountant,
    )
    optimizer = pe.optim.DPAdam(model.parameters(), lr=args.lr, privacy_engine=engine)
    test_loader = DataLoader(test, batch_size=256)
    print(f"{args.model} at {args.img_size}px: {n_trainable:,} trainable parameters; n={len(train)}, "
          f"B={args.batch_size} (physical {args.physical_batch_size}), σ={engine.noise_multiplier:.4f}, "
          f"R={args.max_grad_norm}, mode={args.clipping_mode}, clipping={args.clipping_fn}")

    def per_sample_loss(xb, yb):
        return F.cross_entropy(model(xb), yb, reduction="none")

    start = time.perf_counter()
    model.train()
    for epoch in range(1, args.epochs + 1):
        bar = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for x, y in bar:
            loss = private_logical_step(optimizer, (x, y), per_sample_loss, args.physical_batch_size, device=device)
            bar.set_postfix(loss=f"{loss:.3f}", eps=f"{engine.get_epsilon():.2f}")
        acc = accuracy(model, test_loader, device)
        print(f"epoch {epoch}: test accuracy {acc:.3f}, ε = {engine.get_epsilon():.3f}")
    seconds = time.perf_counter() - start
    acc = accuracy(model, test_loader, device)
    print(f"done: ε = {engine.get_epsilon():.3f}, δ = {engine.target_delta:.2e}, noise multiplier σ = "
          f"{engine.noise_multiplier:.4f}, test accuracy = {acc:.3f}, {seconds:.0f} s")
    return acc


if __name__ == "__main__":
    main()
