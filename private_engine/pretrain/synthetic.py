"""Procedural images for the non-private warm start: no download, no private data.

In the spirit of the OpenGL shaders of Baradad, Chen, Wulff, Wang, Feris, Torralba & Isola,
"Procedural Image Programs for Representation Learning" (Shaders21k), which Yu et al., "ViP: A
Differentially Private Foundation Model for Computer Vision", pre-train their MAE on before any
private data is seen. Four families of programs, each a vectorised torch computation over a whole
chunk of images on a pixel grid ``(u, v) ∈ [−1, 1]²``:

* ``fields``  smooth colour fields: ``s(u, v) = Σ_k a_k cos(2π(f_k·(u, v)) + φ_k)`` with
  low frequencies ``‖f_k‖ ≤ 2``, coloured by a random cosine palette;
* ``stripes`` warped stripes: ``s = tanh(κ·sin(2π f ⟨(u, v) + w(u, v), e_θ⟩ + φ))`` with a
  smooth warp ``w`` (a low-frequency field as above) and a sharpness κ, between two colours;
* ``fractal`` fractal value noise: ``s = Σ_o ρ^o · up(N_o)``, ``N_o`` a ``2^{o+1}``-cell grid of
  U(0, 1) values upsampled bilinearly, persistence ρ ∈ [0.4, 0.8], through a cosine palette;
* ``shapes``  geometric primitives (discs, rotated rectangles, rings, triangles as the
  intersection of three half-planes) painted in random order and colours over a smooth field.

The cosine palette is ``c(t) = a + b·cos(2π(c·t + d))`` per channel (Quilez' palettes, common in
shader programs), clamped to [0, 1]. Images are ``(N, C, S, S)`` float32 in [0, 1]; image j is a
function of ``(seed, j)`` only (chunks of :data:`CHUNK` images draw from generators seeded by
``(seed, chunk index)``), so ``synthetic_images(n)[:m]`` equals ``synthetic_images(m)``.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

__all__ = ["FAMILIES", "CHUNK", "synthetic_images", "SyntheticImages"]

FAMILIES = ("fields", "stripes", "fractal", "shapes")
#: images per generator chunk (fixed: part of what defines image j for a seed)
CHUNK = 512
_TWO_PI = 2 * math.pi


def _grid(size: int):
    t = torch.linspace(-1.0, 1.0, size)
    v, u = torch.meshgrid(t, t, indexing="ij")
    return u, v  # (S, S) each


def _palette(t: torch.Tensor, g: torch.Generator, channels: int) -> torch.Tensor:
    """Cosine palette ``a + b·cos(2π(c·t + d))`` of a scalar field t (B, S, S) → (B, C, S, S)."""
    B = t.shape[0]
    a = 0.2 + 0.6 * torch.rand(B, channels, 1, 1, generator=g)
    b = 0.2 + 0.4 * torch.rand(B, channels, 1, 1, generator=g)
    c = 0.3 + 1.2 * torch.rand(B, channels, 1, 1, generator=g)
    d = torch.rand(B, channels, 1, 1, generator=g)
    return (a + b * torch.cos(_TWO_PI * (c * t.unsqueeze(1) + d))).clamp(0.0, 1.0)


def _smooth(B: int, size: int, g: torch.Generator, terms: int = 4,
            max_freq: float = 2.0) -> torch.Tensor:
    """Σ_k a_k cos(2π f_k·(u, v) + φ_k), normalised to unit peak: (B, S, S)."""
    u, v = _grid(size)
    f = (torch.rand(B, terms, 2, generator=g) * 2 - 1) * max_freq
    phase = torch.rand(B, terms, 1, 1, generator=g) * _TWO_PI
    amp = torch.rand(B, terms, 1, 1, generator=g)
    arg = _TWO_PI * (f[..., 0, None, None] * u + f[..., 1, None, None] * v) + phase
    s = (amp * torch.cos(arg)).sum(1)
    return s / amp.sum(1).clamp_min(1e-6)


def _fields(B, size, g, channels):
    return _palette(_smooth(B, size, g), g, channels)


def _stripes(B, size, g, channels):
    u, v = _grid(size)
    theta = torch.rand(B, 1, 1, generator=g) * math.pi
    freq = 1.0 + 5.0 * torch.rand(B, 1, 1, generator=g)
    phase = torch.rand(B, 1, 1, generator=g) * _TWO_PI
    kappa = 0.5 + 8.0 * torch.rand(B, 1, 1, generator=g)
    warp = 0.3 * torch.rand(B, 1, 1, generator=g) * _smooth(B, size, g)
    proj = (u + warp) * torch.cos(theta) + (v + warp) * torch.sin(theta)
    s = torch.tanh(kappa * torch.sin(_TWO_PI * freq * proj + phase))  # (B, S, S) in (−1, 1)
    c0 = torch.rand(B, channels, 1, 1, generator=g)
    c1 = torch.rand(B, channels, 1, 1, generator=g)
    w = (0.5 + 0.5 * s).unsqueeze(1)
    return c0 * (1 - w) + c1 * w


def _fractal(B, size, g, channels):
    octaves = max(1, int(math.log2(size)) - 1)
    rho = 0.4 + 0.4 * torch.rand(B, 1, 1, 1, generator=g)
    s = torch.zeros(B, 1, size, size)
    for o in range(octaves):
        cells = 2 ** (o + 1)
        noise = torch.rand(B, 1, cells + 1, cells + 1, generator=g)
        up = torch.nn.functional.interpolate(noise, size=(size, size), mode="bilinear",
                                             align_corners=True)
        s = s + rho ** o * up
    s = s / sum(rho ** o for o in range(octaves))
    return _palette(s[:, 0], g, channels)


def _shapes(B, size, g, channels, count: int = 5):
    u, v = _grid(size)
    img = 0.5 * _fields(B, size, g, channels)
    for _ in range(count):
        kind = torch.randint(0, 4, (B, 1, 1), generator=g)
        cx, cy = (torch.rand(B, 1, 1, generator=g) * 1.6 - 0.8 for _ in range(2))
        r = 0.15 + 0.45 * torch.rand(B, 1, 1, generator=g)
        theta = torch.rand(B, 1, 1, generator=g) * math.pi
        du, dv = u - cx, v - cy
        ru = du * torch.cos(theta) + dv * torch.sin(theta)
        rv = -du * torch.sin(theta) + dv * torch.cos(theta)
        dist = (du ** 2 + dv ** 2).sqrt()
        disc = dist < r
        rect = (ru.abs() < r) & (rv.abs() < 0.5 * r)
        ring = (dist < r) & (dist > 0.6 * r)
        tri = torch.ones_like(disc)
        for k in range(3):  # ⟨(du, dv), n_k⟩ < r/2 for three normals 120° apart
            a = theta + k * _TWO_PI / 3
            tri = tri & (du * torch.cos(a) + dv * torch.sin(a) < 0.5 * r)
        inside = torch.where(kind == 0, disc, torch.where(kind == 1, rect,
                                                          torch.where(kind == 2, ring, tri)))
        colour = torch.rand(B, channels, 1, 1, generator=g)
        img = torch.where(inside.unsqueeze(1), colour, img)
    return img


_PROGRAMS = {"fields": _fields, "stripes": _stripes, "fractal": _fractal, "shapes": _shapes}


def _chunk(seed: int, index: int, count: int, size: int, channels: int,
           families: Sequence[str]) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(index))
    kinds = torch.randint(0, len(families), (CHUNK,), generator=g)[:count]
    out = torch.empty(count, channels, size, size)
    for k, name in enumerate(families):
        idx = (kinds == k).nonzero().flatten()
        # every family draws its full chunk so that image j does not depend on the count
        imgs = _PROGRAMS[name](CHUNK, size, g, channels)
        if idx.numel():
            out[idx] = imgs[idx]
    return out


@torch.no_grad()
def synthetic_images(n: int, size: int = 32, seed: int = 0, channels: int = 3,
                     families: Sequence[str] = FAMILIES) -> torch.Tensor:
    """``n`` procedural images ``(n, channels, size, size)`` in [0, 1] (see the module
    docstring); each image is one family of ``families``, drawn uniformly."""
    unknown = [f for f in families if f not in _PROGRAMS]
    if unknown or not families:
        raise ValueError(f"unknown image families {unknown}; choose from {FAMILIES}")
    if n < 0 or size < 2 or channels < 1:
        raise ValueError(f"need n ≥ 0, size ≥ 2, channels ≥ 1; got {n}, {size}, {channels}")
    parts = [_chunk(seed, i, min(CHUNK, n - i * CHUNK), size, channels, tuple(families))
             for i in range(math.ceil(n / CHUNK))]
    return torch.cat(parts) if parts else torch.empty(0, channels, size, size)


class SyntheticImages(Dataset):
    """A data set of :func:`synthetic_images`, items ``(x, 0)`` with ``x = (img − mean)/std`` per
    channel (fixed constants, like a model's published normalisation); stored as uint8."""

    def __init__(self, n: int, size: int = 32, seed: int = 0, channels: int = 3,
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 families: Sequence[str] = FAMILIES):
        imgs = synthetic_images(n, size, seed, channels, families)
        self.images = (imgs * 255).round().to(torch.uint8)
        shape = (channels, 1, 1)
        self.mean = torch.tensor(mean if mean is not None else [0.5] * channels).view(shape)
        self.std = torch.tensor(std if std is not None else [0.5] * channels).view(shape)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i):
        x = self.images[i].float() / 255.0
        return (x - self.mean) / self.std, 0
