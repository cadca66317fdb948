"""Hugging Face models for the layer plan, built from a ``config.json`` already on disk.

Only the architecture matters to a plan (its shapes T, D, p), so the model is built by
``transformers.AutoModel.from_config`` with fresh random weights: nothing is downloaded, and a
directory that holds only ``config.json`` (no weights) is enough.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch
from torch import nn


def local_hf_config(name: str):
    """The ``transformers`` config of ``name`` — a directory with a ``config.json``, or a hub id
    already in the local Hugging Face cache — or ``None`` when neither is on disk (no network)."""
    try:
        from transformers import AutoConfig
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"{name!r} is a directory without a config.json: point --model at the "
                         "folder that holds the model's config.json")
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:
        if os.path.isdir(name):
            raise ValueError(f"cannot read the Hugging Face config in {name!r}: "
                             f"{str(err).splitlines()[0]}") from None
        return None


def hf_model_from_config(config) -> nn.Module:
    """The base model (no task head) of ``config`` with random weights, in train mode."""
    from transformers import AutoModel

    try:
        model = AutoModel.from_config(config)
    except ValueError as err:
        raise ValueError(f"transformers' AutoModel has no model for config type "
                         f"{config.model_type!r}: {str(err).splitlines()[0]}") from None
    return model.train()


def hf_example_input(config, batch_size: int,
                     input_size: Optional[Sequence[int]]) -> Tuple[torch.Tensor, str]:
    """A batch the model accepts as its first argument, and a description of one sample.

    Text models (a ``vocab_size``) take token ids of shape ``(B, T)``, T from ``input_size`` (one
    integer) or ``min(128, max_position_embeddings)``; vision models (an ``image_size``) take
    pixels ``(B, C, H, W)`` from ``input_size`` (C,H,W) or the config's channels and image size.
    """
    image_size = getattr(config, "image_size", None)
    if image_size is not None and not getattr(config, "vocab_size", None):
        if input_size is None:
            side = image_size if isinstance(image_size, int) else image_size[0]
            input_size = (getattr(config, "num_channels", 3), side, side)
        if len(input_size) != 3:
            raise ValueError(f"{config.model_type} takes images: give --input-size as C,H,W, "
                             f"got {','.join(map(str, input_size))}")
        return torch.randn(batch_size, *input_size), f"pixels {tuple(input_size)}"
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        raise ValueError(f"cannot tell what {config.model_type} takes as input (its config has "
                         "neither vocab_size nor image_size)")
    positions = getattr(config, "max_position_embeddings", None)
    if input_size is None:
        input_size = (min(128, positions or 128),)
    if len(input_size) != 1:
        raise ValueError(f"{config.model_type} takes token ids: give --input-size as one "
                         f"sequence length T, got {','.join(map(str, input_size))}")
    if positions and input_size[0] > positions:
        raise ValueError(f"{config.model_type} takes at most {positions} tokens "
                         f"(max_position_embeddings): give --input-size T <= {positions}, "
                         f"got {input_size[0]}")
    return (torch.randint(0, vocab, (batch_size, input_size[0])),
            f"{input_size[0]} tokens")
