"""Per-sample MAE masks that cannot move with the batch: a keyed pseudorandom function of the
step and of the sample's own content.

The masked-autoencoder loss of Yu, Sanjabi, Ma, Chaudhuri & Guo, "ViP: A Differentially Private
Foundation Model for Computer Vision" (their eq. 4, after He et al., "Masked Autoencoders Are
Scalable Vision Learners") hides a random subset of each sample's patches. Under DP-SGD (Abadi et
al., "Deep Learning with Differential Privacy") the release of step t is

    ĝ_t = ( Σ_{i∈B_t} clip_R(∇_θ ℓ(x_i, π_{t,i}; θ_t)) + N(0, σ²R²I) ) / B,

and its sensitivity to one sample is R only if every other term of the sum is the same with or
without that sample. So sample i's mask π_{t,i} may depend on x_i and on public quantities (the
step t), never on where x_i sits in the batch or on how many samples came before it, in this step
or any earlier one: a mask stream drawn row by row from one generator gives every sample after an
inserted one another mask, and every later step other masks.

:class:`KeyedMasks` computes, with a secret 256-bit key K,

    d_{t,i} = BLAKE2b_K(t ‖ dtype ‖ shape ‖ bytes(x_i))          (keyed BLAKE2b, RFC 7693)
    u_{t,i} = SHAKE-256(d_{t,i}) read as L integers of 64 bits     (FIPS 202 extendable output)
    π_{t,i} = argsort(u_{t,i})      (the first K = ⌊L(1 − r)⌋ entries are the visible patches)

BLAKE2b in keyed mode is a pseudorandom function (Aumasson, Neves, Wilcox-O'Hearn & Winnerlein,
"BLAKE2: simpler, smaller, fast as MD5"), so for a key unknown to the adversary the masks are
pseudorandom and distinct across steps and samples, and the argsort of L independent uniform
64-bit words is a uniform permutation (ties aside, probability < L²/2⁶⁴).

Privacy. For a fixed key, π_{t,i} is a deterministic function of (t, x_i): the per-sample loss
``x ↦ ℓ(x, π_t(x); θ)`` is one fixed function of the sample, like a deterministic data
augmentation, and the clipped sum changes by at most R when one sample is added or removed,
wherever it lands in the batch and whatever the earlier batches held. This holds for any key,
which makes the bound measurable with a fixed (user-given) key; by default the key is secret
anyway (:func:`private_engine.foundation.randomness.secret_generator`: 256 bits drawn from a
generator whose whole state comes from ``os.urandom``), so that nobody can predict the masks.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

from ..foundation.randomness import secret_generator

__all__ = ["KeyedMasks"]

#: BLAKE2b personalisation: the masks of this module and no other use of the key
_PERSON = b"pe.mae.masks.v1"


class KeyedMasks:
    """``ids(images, step)``: each sample's MAE mask as a keyed pseudorandom function of the step
    and of the sample's own bytes (see the module docstring).

    Args:
        num_patches: L, the patches per image (``MaskedAutoencoder.num_patches``).
        seed: None (default): a secret 256-bit key from OS entropy. An int, a ``torch.Generator``
            or a numpy ``Generator``: the key is drawn from it (reproducible masks, with a
            :class:`~private_engine.foundation.randomness.ReproducibleRandomnessWarning`).
        generator: a generator already made by the caller (no further warning): the key is drawn
            from it; exclusive with ``seed``.
    """

    KEY_BYTES = 32

    def __init__(self, num_patches: int, seed: Any = None,
                 generator: Optional[torch.Generator] = None):
        if num_patches < 1:
            raise ValueError(f"num_patches must be ≥ 1, got {num_patches}")
        if seed is not None and generator is not None:
            raise ValueError("give seed or generator, not both")
        self.num_patches = int(num_patches)
        if generator is None:
            generator = secret_generator(seed, "cpu", "the MAE masks")
        words = torch.randint(0, 1 << 32, (self.KEY_BYTES // 4,), generator=generator,
                              dtype=torch.int64)
        self._key = b"".join(int(w).to_bytes(4, "little") for w in words.tolist())

    # -- the masks -------------------------------------------------------------------------------
    def words(self, images: torch.Tensor, step: int) -> torch.Tensor:
        """``u_t`` (B, L) int64: row i is SHAKE-256 of ``BLAKE2b_K(t ‖ dtype ‖ shape ‖ x_i)``.

        Row i reads sample i's bytes (on the CPU) and nothing else of the batch."""
        if step < 0:
            raise ValueError(f"step must be ≥ 0, got {step}")
        x = images.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.contiguous()
        n = x.shape[0]
        header = (int(step).to_bytes(8, "little") + str(x.dtype).encode() + b"|"
                  + repr(tuple(x.shape[1:])).encode() + b"|")
        rows = x.reshape(n, -1).view(torch.uint8).numpy() if n else None
        out = bytearray()
        size = 8 * self.num_patches
        for i in range(n):
            d = hashlib.blake2b(header, key=self._key, person=_PERSON, digest_size=64)
            d.update(memoryview(rows[i]))
            out += hashlib.shake_256(d.digest()).digest(size)
        if not n:
            return torch.empty(0, self.num_patches, dtype=torch.int64)
        return torch.frombuffer(out, dtype=torch.int64).reshape(n, self.num_patches).clone()

    def ids(self, images: torch.Tensor, step: int) -> torch.Tensor:
        """``ids_shuffle`` (B, L) int64 for ``MaskedAutoencoder.forward``: row i is the
        permutation ``argsort(u_{t,i})`` (sample i keeps its first K patches)."""
        return torch.argsort(self.words(images, step), dim=1, stable=True)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"key": uint8 tensor}``: as secret as the data (it predicts every mask)."""
        return {"key": torch.tensor(list(self._key), dtype=torch.uint8)}

    def load_state_dict(self, state: dict) -> None:
        """Take the key of :meth:`state_dict` (a resumed run keeps its masks)."""
        key = state["key"]
        if key.dtype != torch.uint8 or key.numel() != self.KEY_BYTES:
            raise ValueError(f"a mask key is {self.KEY_BYTES} bytes (uint8), got "
                             f"{key.dtype} × {key.numel()}")
        self._key = bytes(key.tolist())

    def broadcast_(self, device: torch.device, src: int = 0) -> None:
        """Every rank takes rank ``src``'s key (one ``torch.distributed.broadcast`` on
        ``device``: CUDA for NCCL), so that a sample's mask does not depend on its rank."""
        import torch.distributed as dist

        key = torch.frombuffer(bytearray(self._key), dtype=torch.int64).to(device)
        dist.broadcast(key, src=src)
        self._key = key.cpu().numpy().tobytes()

    def __repr__(self) -> str:
        return f"KeyedMasks(num_patches={self.num_patches}, key=<{8 * self.KEY_BYTES} bits>)"
