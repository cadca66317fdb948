"""A masked autoencoder on a timm ViT encoder, returning one reconstruction loss per sample.

He, Chen, Xie, Li, Dollár & Girshick, "Masked Autoencoders Are Scalable Vision Learners" (MAE),
as used for private pre-training by Yu, Sanjabi, Ma, Chaudhuri & Guo, "ViP: A Differentially
Private Foundation Model for Computer Vision" (their eq. 4):

    L_MAE(θ) = (1/n) Σ_i ℓ(x_i; θ),   ℓ(x_i; θ) = ℓ_MSE(g ∘ ψ(mask(x_i); θ), x_i)

with ψ the encoder (a timm ``VisionTransformer``), g a small ViT decoder and ``mask`` hiding a
fraction ``r`` (0.75) of the patches, a different random subset per sample. The loss of sample i
depends on x_i (and its own mask noise) only, so it can be clipped per sample.

Every op follows the engine's parameter-entry tracer (``private_engine/capture/tracer``):

* masking: ``ids_shuffle = argsort(u_i)`` of per-sample noise ``u_i ~ U(0,1)^L``; the kept
  tokens are ``gather(x_i, 1, ids_shuffle[:K])``, ``K = ⌊L(1 − r)⌋`` — row-wise, sample i's rows
  only;
* ``pos_embed``, ``cls_token``, ``decoder_pos_embed`` enter by ``+`` and ``cat`` of a
  batch-expanded token, as in timm's own ``_pos_embed``;
* the mask token enters by ``where(m_i, mask_token, x̃_i)`` after un-shuffling
  ``x̃_i = gather([x_i^vis, 0], 1, argsort(ids_shuffle))``.

The masks can be passed in (``forward(imgs, ids_shuffle=ids)`` or ``forward(imgs, noise=u)``), so
that the masks of a batch can be reproduced one sample at a time. Private training passes the
masks of :class:`private_engine.pretrain.masks.KeyedMasks` (each sample's mask a keyed function of
the step and of its own content, whatever its place in the batch). Without masks, ``forward``
draws them i.i.d. from a fresh secret generator
(:func:`private_engine.foundation.randomness.entropy_seeded_generator`), never from torch's global
one.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ..foundation.randomness import entropy_seeded_generator

__all__ = ["MaskedAutoencoder", "build_mae", "sincos_pos_embed_2d", "patchify"]


def sincos_pos_embed_2d(dim: int, grid: Tuple[int, int], prefix: int = 1) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embedding ``(1, prefix + h·w, dim)`` (prefix rows 0).

    For a patch at row y, column x: half the channels encode y and half x, each as
    ``[sin(p·ω_k), cos(p·ω_k)]`` with ``ω_k = 10000^{-k/(dim/4)}``, k = 0..dim/4 − 1 (Vaswani et
    al., "Attention Is All You Need", in 2-D as in He et al., "Masked Autoencoders Are Scalable
    Vision Learners"). Used to initialise the trainable decoder position embedding.
    """
    if dim % 4:
        raise ValueError(f"sine-cosine position embedding needs dim % 4 == 0, got {dim}")
    h, w = grid
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64),
                            torch.arange(w, dtype=torch.float64), indexing="ij")
    parts = []
    for pos in (ys.reshape(-1), xs.reshape(-1)):
        out = pos[:, None] * omega[None]
        parts += [out.sin(), out.cos()]
    emb = torch.cat(parts, dim=1).float()
    return torch.cat([torch.zeros(prefix, dim), emb], dim=0).unsqueeze(0)


def patchify(imgs: torch.Tensor, patch: int) -> torch.Tensor:
    """``(B, C, H, W) → (B, L, p²·C)``, L = (H/p)(W/p): patch l's pixels in (row, col, channel)
    order."""
    B, C, H, W = imgs.shape
    if H % patch or W % patch:
        raise ValueError(f"image size {H}×{W} is not a multiple of the patch size {patch}")
    h, w = H // patch, W // patch
    x = imgs.reshape(B, C, h, patch, w, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(B, h * w, patch * patch * C)


class MaskedAutoencoder(nn.Module):
    """MAE with a timm ViT encoder; ``forward(imgs, noise=None)`` returns the per-sample loss.

    Per sample i, with patches ``P_i ∈ R^{L×p²C}``, the masked set ``M_i`` (``|M_i| = L − K``)
    and the decoder's prediction ``P̂_i``:

        ℓ_i = (1/|M_i|) Σ_{l∈M_i} (1/p²C) ‖P̂_{i,l} − T_{i,l}‖²,
        T_{i,l} = (P_{i,l} − mean(P_{i,l})) / √(var(P_{i,l}) + 10⁻⁶)   (``norm_pix_loss``)

    (He et al., "Masked Autoencoders Are Scalable Vision Learners", normalised-pixel target;
    ``norm_pix_loss=False`` uses ``T = P``.)

    Args:
        encoder: a timm ``VisionTransformer`` built without a classifier (``num_classes=0``), with
            ``fc_norm=False`` when it pools by average (its ``norm`` is then the final LayerNorm)
            and without register tokens or attention pooling: every trainable parameter of the
            encoder must be used by the reconstruction, else it would get no gradient.
        decoder_dim / decoder_depth / decoder_heads / mlp_ratio: the decoder ViT (timm
            ``Block`` s).
        mask_ratio: fraction r of the patches hidden from the encoder.
        norm_pix_loss: normalise each target patch by its own mean and variance.
    """

    def __init__(self, encoder: nn.Module, decoder_dim: int = 128, decoder_depth: int = 2,
                 decoder_heads: int = 4, mlp_ratio: float = 4.0, mask_ratio: float = 0.75,
                 norm_pix_loss: bool = True):
        super().__init__()
        from timm.models.vision_transformer import Block

        _check_encoder(encoder)
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
        self.encoder = encoder
        self.mask_ratio = float(mask_ratio)
        self.norm_pix_loss = norm_pix_loss
        pe = encoder.patch_embed
        self.patch_size = int(pe.patch_size[0])
        self.grid = tuple(int(g) for g in pe.grid_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.in_chans = int(pe.proj.in_channels)
        self.has_cls = encoder.cls_token is not None
        embed_dim = encoder.embed_dim
        prefix = 1 if self.has_cls else 0
        self.decoder_embed = nn.Linear(embed_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        nn.init.normal_(self.mask_token, std=0.02)
        pos = (sincos_pos_embed_2d(decoder_dim, self.grid, prefix) if decoder_dim % 4 == 0
               else 0.02 * torch.randn(1, prefix + self.num_patches, decoder_dim))
        self.decoder_pos_embed = nn.Parameter(pos)
        self.decoder_blocks = nn.Sequential(*[
            Block(decoder_dim, decoder_heads, mlp_ratio, qkv_bias=True)
            for _ in range(decoder_depth)])
        self.decoder_norm = nn.LayerNorm(decoder_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_dim, self.patch_size ** 2 * self.in_chans)

    @property
    def num_kept(self) -> int:
        """K = ⌊L·(1 − r)⌋ visible patches per sample (at least 1)."""
        return max(1, int(self.num_patches * (1.0 - self.mask_ratio)))

    def mask_noise(self, batch: int, device=None,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Per-sample mask noise ``u ~ U(0, 1)^{B×L}``; sample i keeps its K lowest-noise
        patches.

        ``generator`` None: a fresh ``entropy_seeded_generator`` (secret, full entropy; never
        torch's global generator, which scripts seed publicly). Row i is the i-th draw of one
        stream, so a sample's noise depends on its row: this is private only because the stream
        is secret and i.i.d. (the honest rows have the same joint distribution with or without
        another sample). Training uses :class:`~private_engine.pretrain.masks.KeyedMasks`, whose
        masks do not move at all.
        """
        if generator is None:
            generator = entropy_seeded_generator(device if device is not None else "cpu")
        return torch.rand(batch, self.num_patches, device=device, generator=generator)

    def shuffle_ids(self, noise: torch.Tensor) -> torch.Tensor:
        """``ids_shuffle = argsort(u_i)`` per row of the mask noise ``u`` (B, L): sample i keeps
        the patches ``ids_shuffle[i, :K]``."""
        return torch.argsort(noise, dim=1)

    def random_masking(self, x: torch.Tensor, ids_shuffle: torch.Tensor):
        """``(x_vis (B, K, D), mask (B, L) with 1 = hidden, ids_restore (B, L))``.

        ``x_vis = gather(x_i, ids_shuffle[:K])``, ``ids_restore = argsort(ids_shuffle)``: each
        row only reorders its own sample's tokens.
        """
        B, L, D = x.shape
        if ids_shuffle.shape != (B, L) or ids_shuffle.is_floating_point():
            raise ValueError(f"ids_shuffle must be an integer tensor of shape {(B, L)}, got "
                             f"{ids_shuffle.dtype} {tuple(ids_shuffle.shape)}")
        K = self.num_kept
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :K]
        x_vis = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(B, K, D))
        mask = torch.ones(B, L, device=x.device, dtype=x.dtype)
        mask[:, :K] = 0
        mask = torch.gather(mask, 1, ids_restore)
        return x_vis, mask, ids_restore

    def forward_encoder(self, imgs: torch.Tensor, ids_shuffle: torch.Tensor):
        """Encode the visible patches: ``(latent (B, prefix + K, D), mask, ids_restore)``."""
        enc = self.encoder
        x = enc.patch_embed(imgs)
        if x.dim() != 3:
            raise ValueError("the encoder's patch_embed must return (B, L, D) tokens "
                             "(a timm ViT built without dynamic_img_size)")
        pos = enc.pos_embed
        if pos is not None:
            x = x + (pos if enc.no_embed_class or not self.has_cls else pos[:, 1:])
        x, mask, ids_restore = self.random_masking(x, ids_shuffle)
        if self.has_cls:
            cls = enc.cls_token
            if pos is not None and not enc.no_embed_class:
                cls = cls + pos[:, :1]
            x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = enc.pos_drop(x)
        x = enc.norm_pre(x)
        x = enc.blocks(x)
        return enc.norm(x), mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, mask: torch.Tensor,
                        ids_restore: torch.Tensor) -> torch.Tensor:
        """Predict every patch: ``(B, L, p²C)``; hidden positions hold the mask token."""
        x = self.decoder_embed(latent)
        B, _, D = x.shape
        prefix = 1 if self.has_cls else 0
        vis = x[:, prefix:]
        pad = torch.zeros(B, self.num_patches - vis.shape[1], D, device=x.device, dtype=x.dtype)
        full = torch.cat([vis, pad], dim=1)
        full = torch.gather(full, 1, ids_restore.unsqueeze(-1).expand(B, self.num_patches, D))
        full = torch.where(mask.unsqueeze(-1) > 0, self.mask_token.to(full.dtype), full)
        if prefix:
            full = torch.cat([x[:, :1], full], dim=1)
        full = full + self.decoder_pos_embed
        full = self.decoder_blocks(full)
        full = self.decoder_norm(full)
        return self.decoder_pred(full)[:, prefix:]

    def target(self, imgs: torch.Tensor) -> torch.Tensor:
        """The reconstruction target ``T`` (B, L, p²C): patches, normalised per patch if
        ``norm_pix_loss``."""
        t = patchify(imgs, self.patch_size)
        if self.norm_pix_loss:
            mean = t.mean(dim=-1, keepdim=True)
            var = t.var(dim=-1, keepdim=True)
            t = (t - mean) / (var + 1e-6).sqrt()
        return t

    def forward(self, imgs: torch.Tensor, noise: Optional[torch.Tensor] = None,
                ids_shuffle: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Per-sample masked reconstruction loss ``ℓ_i`` (B,) (see the class docstring).

        The masks: ``ids_shuffle`` (B, L) integer, each row a permutation of the patches (the
        first K kept), or ``noise`` (B, L) whose row-wise argsort gives it, or noise drawn from
        ``generator`` (None: a fresh secret one, :meth:`mask_noise`) when both are None.
        Integer ids are the form to pass in training: the engine's separability probe then has
        no float input without a gradient to compare.
        """
        if ids_shuffle is None:
            if noise is None:
                noise = self.mask_noise(imgs.shape[0], imgs.device, generator)
            ids_shuffle = self.shuffle_ids(noise)
        latent, mask, ids_restore = self.forward_encoder(imgs, ids_shuffle)
        pred = self.forward_decoder(latent, mask, ids_restore)
        err = (pred - self.target(imgs).to(pred.dtype)).pow(2).mean(dim=-1)
        return (err * mask).sum(dim=1) / (self.num_patches - self.num_kept)


def _check_encoder(encoder: nn.Module) -> None:
    """Refuse encoders the reconstruction would not use entirely (their unused trainable
    parameters would receive no gradient) or that it cannot drive."""
    name = type(encoder).__name__
    for attr in ("patch_embed", "pos_embed", "cls_token", "blocks", "norm", "embed_dim"):
        if not hasattr(encoder, attr):
            raise ValueError(f"{name} is not a timm VisionTransformer: it has no {attr!r}")
    if getattr(encoder, "reg_token", None) is not None:
        raise ValueError(f"{name}: register tokens are not supported by the MAE "
                         "(build the encoder with reg_tokens=0)")
    if getattr(encoder, "dynamic_img_size", False):
        raise ValueError(f"{name}: build the encoder without dynamic_img_size")
    unused = []
    for attr in ("fc_norm", "head", "attn_pool"):
        mod = getattr(encoder, attr, None)
        if isinstance(mod, nn.Module):
            unused += [f"{attr}.{n}" for n, p in mod.named_parameters() if p.requires_grad]
    if unused:
        raise ValueError(f"{name}: trainable parameters {unused} are not used by the masked "
                         "reconstruction and would get no gradient; build the encoder with "
                         "num_classes=0 (and fc_norm=False with global_pool='avg', no "
                         "attention pooling) or freeze them")


def build_mae(model: str = "vit_tiny_patch16_224", img_size: int = 32, patch_size: int = 4,
              depth: Optional[int] = None, embed_dim: Optional[int] = None,
              num_heads: Optional[int] = None, in_chans: int = 3, decoder_dim: int = 128,
              decoder_depth: int = 2, decoder_heads: int = 4, mask_ratio: float = 0.75,
              norm_pix_loss: bool = True, **encoder_kwargs) -> MaskedAutoencoder:
    """A :class:`MaskedAutoencoder` on ``timm.create_model(model, …)`` built offline (random
    weights): class token, average pooling over the patch tokens for features (``fc_norm=False``,
    so the encoder's final LayerNorm is used by both the reconstruction and the features),
    ``num_classes=0``. ``depth``/``embed_dim``/``num_heads`` override the named architecture."""
    import timm

    kwargs = dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=0,
                  global_pool="avg", fc_norm=False, class_token=True)
    for key, value in (("depth", depth), ("embed_dim", embed_dim), ("num_heads", num_heads)):
        if value is not None:
            kwargs[key] = value
    kwargs.update(encoder_kwargs)
    encoder = timm.create_model(model, pretrained=False, **kwargs)
    return MaskedAutoencoder(encoder, decoder_dim=decoder_dim, decoder_depth=decoder_depth,
                             decoder_heads=decoder_heads, mask_ratio=mask_ratio,
                             norm_pix_loss=norm_pix_loss)
