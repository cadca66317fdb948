"""Differentially private MAE pre-training with a synthetic warm start (DP-MAES).

Yu, Sanjabi, Ma, Chaudhuri & Guo, "ViP: A Differentially Private Foundation Model for Computer
Vision": pre-train a masked autoencoder (He et al., "Masked Autoencoders Are Scalable Vision
Learners") on procedurally generated images without privacy, then continue on the private images
with DP-AdamW at (ε, δ) = (8, 1/(2n)), C = 0.1.

* :mod:`.mae` — :class:`MaskedAutoencoder` on a timm ViT (per-sample masks, per-sample loss),
  :func:`build_mae`;
* :mod:`.masks` — :class:`KeyedMasks`: each sample's mask a keyed pseudorandom function of the
  step and of its own content (secret key), whatever the rest of the batch;
* :mod:`.synthetic` — :func:`synthetic_images`, :class:`SyntheticImages` (procedural images);
* :mod:`.recipe` — :func:`pretrain_synthetic` (step 1), :func:`dp_mae_train` (step 2),
  :func:`dp_maes` (both);
* :mod:`.evaluate` — :func:`reconstruction_loss`, :func:`encoder_features`,
  :func:`probe_encoder` (non-private and DP linear probes), table and plot.

See ``docs/pretrain.md``.
"""
from .evaluate import (
                       ProbeRow,
                       encoder_features,
                       format_comparison,
                       plot_comparison,
                       probe_encoder,
                       reconstruction_loss,
)
from .mae import MaskedAutoencoder, build_mae, patchify, sincos_pos_embed_2d
from .masks import KeyedMasks
from .recipe import (
                       DPMAEConfig,
                       DPMAEResult,
                       SyntheticConfig,
                       dp_mae_train,
                       dp_maes,
                       pretrain_synthetic,
)
from .synthetic import FAMILIES, SyntheticImages, synthetic_images

__all__ = ["MaskedAutoencoder", "build_mae", "patchify", "sincos_pos_embed_2d", "KeyedMasks",
           "FAMILIES",
           "SyntheticImages", "synthetic_images", "SyntheticConfig", "DPMAEConfig",
           "DPMAEResult", "pretrain_synthetic", "dp_mae_train", "dp_maes", "ProbeRow",
           "reconstruction_loss", "encoder_features", "probe_encoder", "format_comparison",
           "plot_comparison"]
