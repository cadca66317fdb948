"""The model and the data every method trains: a timm or torchvision model or the text model
built here (fixed seed: the same initialisation for every method), the parameters frozen, and
the fixed random batch (images, or token ids for the text model)."""
from __future__ import annotations

import fnmatch
from typing import List, Optional

from .config import (
    FROZEN,
    TEXT_DEPTH,
    TEXT_DIM,
    TEXT_HEADS,
    TEXT_MODEL,
    TEXT_VOCAB,
    TORCHVISION_MODELS,
)


class Skip(Exception):
    """A method that would only repeat another one on this model (reported in the table, not
    run)."""


def build_model(args, method: str = "nondp"):
    """The model (fixed seed, so the same initialisation for every method) and notes on what was
    changed.

    Every parameter is trainable except those matching ``--freeze`` (every method) and, for the
    ``*_frozen`` methods, ``--frozen-set``. Nothing is frozen because private_engine lacks a rule:
    that method then fails and the table shows its error.
    """
    import torch

    import private_engine
    from private_engine.demo.models import create_model
    from private_engine.guards.model_check import (
        batchnorm_modules,
        fallback_modules,
        traced_parameters,
    )

    torch.manual_seed(args.seed)
    model = _create(create_model, args)
    notes = {}
    if batchnorm_modules(model):
        model = private_engine.fix_batchnorm(model)
        notes["batchnorm"] = ("BatchNorm replaced by GroupNorm (private_engine.fix_batchnorm) for "
                              "every method")
    if args.no_inplace:
        inplace_activations_off(model)
        notes["inplace"] = "in-place activations disabled (--no-inplace) for every method"
    notes["traced"] = traced_parameters(model)  # how private_engine clips parameters outside layers
    notes["fallback"] = fallback_modules(model)
    by_glob = matching(model, args.freeze)
    by_set = matching(model, args.frozen_set) if method.endswith(FROZEN) else []
    if method.endswith(FROZEN) and not by_set:
        raise Skip(f"no parameter matches --frozen-set {' '.join(args.frozen_set)}: "
                   f"same as {method[:-len(FROZEN)]}")
    params = dict(model.named_parameters())
    for name in set(by_glob) | set(by_set):
        params[name].requires_grad_(False)
    notes["frozen_glob"] = by_glob
    notes["frozen_set"] = by_set
    notes["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtype = getattr(torch, args.dtype)
    return model.to(device=args.device, dtype=dtype).train(), notes


def matching(model, globs) -> List[str]:
    """Names of trainable parameters matching any of ``globs`` (fnmatch)."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and any(fnmatch.fnmatch(n, g) for g in globs)]


def _create(create_model, args):
    """The text model is built here; ``TORCHVISION_MODELS`` come from torchvision; timm models get
    ``img_size`` when they take it (ViTs; CNNs do not need it). Random initialisation, nothing
    downloaded."""
    import timm

    if args.model == TEXT_MODEL:
        return text_transformer(args.num_classes, args.seq_len)
    if args.model in TORCHVISION_MODELS:
        import torchvision

        return torchvision.models.get_model(args.model, weights=None, num_classes=args.num_classes)
    if timm.is_model(args.model):
        try:
            return create_model(args.model, num_classes=args.num_classes, img_size=args.img_size)
        except TypeError:
            pass
    return create_model(args.model, num_classes=args.num_classes)


def text_transformer(num_classes: int, seq_len: int):
    """A small token classifier built from layers both libraries know: token and position
    embeddings (``nn.Embedding``), four timm transformer blocks (Linear, LayerNorm, SDPA
    attention), mean pooling and a Linear head. Input: token ids ``(B, seq_len)``."""
    import torch
    from timm.models.vision_transformer import Block
    from torch import nn

    class TextTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(TEXT_VOCAB, TEXT_DIM)
            self.positions = nn.Embedding(seq_len, TEXT_DIM)
            self.blocks = nn.Sequential(*[Block(TEXT_DIM, TEXT_HEADS, mlp_ratio=4.0,
                                                norm_layer=nn.LayerNorm)
                                          for _ in range(TEXT_DEPTH)])
            self.norm = nn.LayerNorm(TEXT_DIM)
            self.head = nn.Linear(TEXT_DIM, num_classes)

        def forward(self, ids):
            # batch-first ids, materialised: Opacus' ghost embedding norm calls .view() on them
            pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            pos = pos.contiguous()
            h = self.blocks(self.tokens(ids) + self.positions(pos))
            return self.head(self.norm(h).mean(1))

    return TextTransformer()


def make_batch(args, batch_size: Optional[int] = None):
    """A random batch of the right shape, identical for every method: images, or token ids for
    the text model."""
    import torch

    n = batch_size or args.batch_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    if args.model == TEXT_MODEL:
        x = torch.randint(0, TEXT_VOCAB, (n, args.seq_len), generator=gen).to(args.device)
    else:
        x = torch.randn(n, 3, args.img_size, args.img_size, generator=gen)
        x = x.to(args.device, getattr(torch, args.dtype))
    y = torch.randint(0, args.num_classes, (n,), generator=gen)
    return x, y.to(args.device)


def inplace_activations_off(model) -> List[str]:
    """Turn off ``inplace`` on every module that has it set (ReLU(inplace=True) in timm ResNets
    and torchvision's VGG): Opacus' full backward hooks fail on them ("Output 0 of
    BackwardHookFunction is a view and is being modified inplace"). Returns the names of the
    modules changed. private_engine and non-DP training keep them."""
    changed = []
    for name, m in model.named_modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
            changed.append(name)
    return changed
