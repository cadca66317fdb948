"""Where the engine's Gaussian noise comes from: a generator seeded from OS entropy, or a CSPRNG.

The Gaussian mechanism (Abadi et al. 2016, "Deep Learning with Differential Privacy") is private
only if the noise is unknown to the adversary. Noise drawn from a generator with a public seed is
not: whoever re-runs the training on a neighbouring dataset with that seed draws the same noise,
and the difference of the two releases is the difference of the clipped gradients, noiseless. So

* by default (``secure_mode=False``) the engine draws from
  :func:`private_engine.foundation.randomness.entropy_seeded_generator` (the library's one
  randomness policy, :mod:`private_engine.foundation.randomness`): a
  ``torch.Generator`` on the parameters' device whose state comes from the operating system's
  entropy (``os.urandom``) — on the CPU the whole 19,968-bit MT19937 state, elsewhere the 64-bit
  seed the generator keeps (Philox on CUDA) — never from torch's global generator, which user
  code seeds (``torch.manual_seed``) for reproducible initialisation. The draw is the fast one
  (:mod:`private_engine.optim.cpu_noise` on the CPU, one ``normal_`` per chunk elsewhere).
* ``secure_mode=True`` follows Opacus' ``secure_mode``: every bit comes from the OS
  cryptographically secure generator (``os.urandom``), so there is no generator state that an
  observer of the noise could recover (MT19937 and Philox are not cryptographic generators),
  and each coordinate is ``(z₁ + z₂ + z₃ + z₄) / 2`` with ``z_k`` four independent N(0, std²)
  draws (Holohan & Braghin 2021, "Secure Random Sampling in Differential Privacy", §5.1, with
  ``n = 2``), which defeats the floating-point attacks on a single Gaussian sample (Mironov
  2012, "On Significance of the Least Significant Bits for Differential Privacy"; Jin et al.
  2022, "Are We There Yet? Timing and Floating-Point Attacks on Differential Privacy Systems").
  The ``z_k`` are Box–Muller transforms (Box & Muller 1958) of 53-bit uniforms, in float64. It
  costs 32 bytes of OS randomness per coordinate: far slower than the default draw.
* a ``noise_generator`` given by the user is used as given (reproducible runs, tests), with a
  :class:`ReproducibleNoiseWarning`: anyone who knows its seed can remove the noise.

Batch membership under Poisson subsampling must be secret as well (privacy amplification by
subsampling assumes it): give ``private_engine.data.poisson_loader`` an
:func:`entropy_seeded_generator` rather than a seeded one.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from ..foundation.randomness import (
    ReproducibleRandomnessWarning,
    derived_generator,
    entropy_seeded_generator,
)
from . import cpu_noise

#: coordinates per piece of a secure-mode draw (32 MiB of OS randomness, ~100 MiB of float64 work)
SECURE_CHUNK = 1 << 20
#: i.i.d. N(0, std²) draws summed per coordinate in secure mode (2n, n = 2; Holohan & Braghin)
SECURE_DRAWS = 4
#: int64 words of OS randomness requested by one ``os.urandom`` call (1 MiB)
_URANDOM_WORDS = 1 << 17




@dataclass
class NoiseSpec:
    """The noise of a private step: ``N(0, σ²R²I)`` once per logical batch, divided by the
    expected batch size. ``R`` is the clipper's (the clip threshold and the noise scale never
    drift apart)."""

    noise_multiplier: float
    expected_batch_size: int
    generator: Optional[torch.Generator] = None
    secure_mode: bool = False


class ReproducibleNoiseWarning(ReproducibleRandomnessWarning):
    """The engine's noise comes from a user's generator: it is reproducible from its seed."""


def parameters_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first trainable parameter (else of its first parameter, else
    the CPU): where the engine's noise is added, so where its generator lives."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return (trainable or params)[0].device if params else torch.device("cpu")


def engine_noise_generator(model: nn.Module, noise_generator: Optional[torch.Generator],
                           secure_mode: bool, draws: bool = True) -> Optional[torch.Generator]:
    """The generator a :class:`private_engine.PrivacyEngine` draws its noise from.

    * ``secure_mode``: None — every draw comes from the OS generator (:func:`gaussian_noise_`);
      a ``noise_generator`` as well raises ``ValueError`` (reproducible noise is not secure;
      Opacus refuses the same combination).
    * a ``noise_generator``: returned as is, with one :class:`ReproducibleNoiseWarning` (the
      engine makes this call once, at construction).
    * neither: :func:`entropy_seeded_generator` on the device of the model's parameters.
    * ``draws=False`` (a data-parallel rank other than 0, which adds no noise: the release is
      ``Σ_r s_r + σR·ξ`` with ξ drawn on rank 0 alone): the arguments are checked as above and
      None is returned, with no warning.
    """
    if noise_generator is not None and not isinstance(noise_generator, torch.Generator):
        raise TypeError(f"noise_generator must be a torch.Generator or None, got "
                        f"{type(noise_generator).__name__}.")
    if secure_mode:
        if noise_generator is not None:
            raise ValueError(
                "secure_mode=True draws the noise from the operating system's cryptographic "
                "generator; a noise_generator would make it reproducible. Give one or the other.")
        return None
    if not draws:
        return None
    if noise_generator is not None:
        warnings.warn(
            "the noise is reproducible from this generator; anyone who knows its seed can remove "
            "it (leave noise_generator=None for noise seeded from OS entropy).",
            ReproducibleNoiseWarning, stacklevel=3)
        return noise_generator
    return entropy_seeded_generator(parameters_device(model))


def gaussian_noise_(t: torch.Tensor, std: float, generator: Optional[torch.Generator] = None,
                    secure_mode: bool = False) -> torch.Tensor:
    """``t ← std·ξ`` in place (``t`` is overwritten), ξ ~ N(0, I); returns ``t``.

    Default mode: :func:`private_engine.optim.cpu_noise.fill_normal_` from ``generator``
    (blocks on several threads on the CPU, one ``normal_`` elsewhere; torch's global generator
    if ``generator`` is None — the engine always passes its own). A generator on another device
    than ``t`` keys a fresh one on ``t``'s device from its own draws (:func:`generator_on`).
    ``secure_mode``:
    :func:`secure_normal_`, from the OS cryptographic generator; ``generator`` must be None.
    """
    if secure_mode:
        if generator is not None:
            raise ValueError("secure_mode draws from the OS generator: pass generator=None.")
        return secure_normal_(t, std)
    return cpu_noise.fill_normal_(t, std, generator_on(generator, t.device))


#: a generator on another device keyed from a parent's draws (the one policy's function)
generator_on = derived_generator


def secure_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """``t ← std·(z₁ + z₂ + z₃ + z₄)/2`` in place, the ``z_k`` i.i.d. N(0, 1) from OS randomness.

    The sum of 2n i.i.d. N(0, std²) draws divided by √(2n) is N(0, std²). Holohan & Braghin
    ("Secure Random Sampling in Differential Privacy", 2021, §5.1) show that it removes the gaps
    in the set of floating-point values a single Gaussian sample can take, gaps that betray the
    unnoised value (Mironov, "On Significance of the Least Significant Bits for Differential
    Privacy", 2012); n = 2 as in Opacus' ``secure_mode``. Each ``z`` is a Box–Muller transform
    (:func:`_os_standard_normal`) of uniforms of 53 bits from ``os.urandom`` (the kernel's
    CSPRNG), computed in float64 on ``t``'s device and rounded once to ``t``'s dtype; drawn in
    pieces of ``SECURE_CHUNK`` coordinates.
    """
    if not t.is_floating_point():
        raise TypeError(f"Gaussian noise needs a floating-point tensor, got {t.dtype}.")
    contiguous = t.is_contiguous()
    flat = t.view(-1) if contiguous else torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    for start in range(0, flat.numel(), SECURE_CHUNK):
        piece = flat[start:start + SECURE_CHUNK]
        z = _os_standard_normal(SECURE_DRAWS * piece.numel(), piece.device)
        piece.copy_(z.view(SECURE_DRAWS, -1).sum(0).mul_(std / math.sqrt(SECURE_DRAWS)))
    if not contiguous:
        t.copy_(flat.view(t.shape))
    return t


def _os_standard_normal(n: int, device: torch.device) -> torch.Tensor:
    """``n`` i.i.d. N(0, 1) float64 values on ``device`` by the Box–Muller transform (Box & Muller
    1958, "A Note on the Generation of Random Normal Deviates"): for independent uniforms
    ``u₁ ∈ (0, 1]`` and ``u₂ ∈ [0, 1)``, ``√(−2 ln u₁)·cos(2πu₂)`` and ``√(−2 ln u₁)·sin(2πu₂)``
    are two independent standard normals. Each uniform is 53 random bits (float64's precision)
    from :func:`_os_random_words`."""
    pairs = (n + 1) // 2
    bits = _os_random_words(2 * pairs).to(device)
    u = ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64).mul_(2.0 ** -53).view(2, pairs)
    radius = u[0].add_(2.0 ** -53).log_().mul_(-2.0).sqrt_()  # u₁ = (k + 1)/2⁵³ ∈ (0, 1]
    angle = u[1].mul_(2 * math.pi)
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]


def _os_random_words(n: int) -> torch.Tensor:
    """``n`` int64 values on the CPU, every bit from ``os.urandom`` (the OS cryptographically
    secure generator), requested in pieces of ``_URANDOM_WORDS`` words on
    ``torch.get_num_threads()`` threads (``os.urandom`` releases the GIL)."""
    out = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return out
    pieces = out.split(_URANDOM_WORDS)

    def fill(piece: torch.Tensor) -> None:
        raw = torch.frombuffer(bytearray(os.urandom(8 * piece.numel())), dtype=torch.uint8)
        piece.view(torch.uint8).copy_(raw)

    workers = min(torch.get_num_threads(), len(pieces))
    if workers < 2:
        for piece in pieces:
            fill(piece)
    else:
        list(cpu_noise._thread_pool(workers).map(fill, pieces))
    return out


__all__ = ["NoiseSpec", "ReproducibleNoiseWarning", "entropy_seeded_generator",
           "engine_noise_generator", "gaussian_noise_", "secure_normal_", "generator_on",
           "parameters_device"]


#: elements drawn by one ``normal_`` call in ``add_gaussian_noise`` (64 MiB of float32)
NOISE_CHUNK = 1 << 24


def add_gaussian_noise(tensors: Sequence[torch.Tensor], std: float,
                       generator: Optional[torch.Generator] = None,
                       secure_mode: bool = False) -> None:
    """``t ← t + std·ξ_t`` in place for every tensor, ξ ~ N(0, I) independent across all coordinates
    (the Gaussian mechanism's noise, Abadi et al. 2016; Bu, Mao & Xu 2022, Alg. 1). The tensors must
    not overlap.

    Consecutive tensors of one device and dtype share one ``normal_`` draw of at most
    ``NOISE_CHUNK`` elements, added by one ``_foreach_add_``; a contiguous tensor larger than that
    (a flat buffer of clipped sums) is noised chunk by chunk. So a step costs a few kernel launches
    here, not two per parameter tensor, and at most one chunk of noise is alive at a time. A chunk
    that is one contiguous tensor gets its noise from :func:`private_engine.optim.cpu_noise.
    add_normal_` (on the CPU drawn and added block by block on several threads, each block by its
    own generator keyed from ``generator``; elsewhere one ``normal_`` and one ``add_``), the same
    numbers as :func:`gaussian_noise_` of a tensor of its size. ``secure_mode``: each chunk from
    the OS cryptographic generator instead, as the sum of four draws over two
    (:func:`private_engine.optim.noise.gaussian_noise_`); ``generator`` must be None.
    """
    group: List[torch.Tensor] = []
    size = 0

    def flush():
        if not group:
            return
        first = group[0]
        if len(group) == 1 and first.is_contiguous() and not secure_mode:
            # one tensor (a flat buffer's chunk): drawn and added block by block, in the cache
            cpu_noise.add_normal_(first, std, generator_on(generator, first.device))
            group.clear()
            return
        noise = gaussian_noise_(torch.empty(size, device=first.device, dtype=first.dtype), std,
                                generator, secure_mode)
        views, offset = [], 0
        for t in group:
            views.append(noise[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        torch._foreach_add_(group, views)
        group.clear()

    pieces: List[torch.Tensor] = []
    for t in tensors:
        if t.numel() > NOISE_CHUNK and t.is_contiguous():
            pieces.extend(t.view(-1).split(NOISE_CHUNK))
        else:
            pieces.append(t)
    for t in pieces:
        if group and (t.device != group[0].device or t.dtype != group[0].dtype
                      or size + t.numel() > NOISE_CHUNK):
            flush()
            size = 0
        group.append(t)
        size += t.numel()
    flush()
