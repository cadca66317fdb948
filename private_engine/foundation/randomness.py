"""The one randomness policy: every random draw that touches a release comes from here.

Differential privacy holds only if the adversary cannot predict the mechanism's randomness: the
Gaussian noise (Abadi et al. 2016, "Deep Learning with Differential Privacy"), the Poisson batch
membership that privacy amplification by subsampling assumes, and any randomness a private loss
uses (masked-autoencoder masks, dropout). A generator with a public seed, or with a seed small
enough to enumerate, gives that randomness away: whoever knows the other records re-runs the
computation for each candidate seed and subtracts. So

* :func:`entropy_seeded_generator` gives a ``torch.Generator`` whose whole state comes from the
  operating system's entropy (``os.urandom``): on the CPU all 19,968 bits of torch's MT19937
  (``manual_seed`` would keep only the low 32 bits of any seed: ``manual_seed(s)`` and
  ``manual_seed(s + 2**32)`` draw the same numbers), on CUDA the 64-bit Philox key;
* :func:`secret_generator` is the one entry point for code that accepts a user's generator or seed
  (``noise_generator=``, ``random_state=``, ``generator=``): ``None`` gives a fresh
  :func:`entropy_seeded_generator`; anything else is used as given, with a
  :class:`ReproducibleRandomnessWarning` that names what it makes reproducible; an integer seed is
  expanded by SHAKE-256 to a full state (never truncated to 32 bits);
* :func:`derived_generator` keys a generator on another device from a parent's draws (the parent
  advances), with a full state on the CPU.

None of these is a cryptographic generator (MT19937 and Philox are not); the engine's
``secure_mode`` draws its noise from the OS generator itself.
"""
from __future__ import annotations

import hashlib
import numbers
import os
import random
import secrets
import sys
import threading
import warnings
from typing import Any, List, Optional, Union

import torch

DeviceLike = Union[str, torch.device]

MT_N = 624  # words of MT19937 state
_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplState), torch ≥ 1.6 (checked at run time)
_LEFT, _NEXT, _WORDS = 8, 16, 24  # byte offsets of `left`, `next` and the 624 uint64 state words
_NORMAL_VALID, _FLOAT_NORMAL_VALID = 5040, 5052  # cached Box–Muller samples: must read "not valid"
#: the domain tag hashed with an integer seed (fixed bytes: a seed draws the same whatever the
#: package layout)
_SEED_DOMAIN = b"private_engine.foundation.randomness.seed"

_lock = threading.Lock()
_template: Optional[torch.Tensor] = None
_checked = False


class ReproducibleRandomnessWarning(UserWarning):
    """Randomness that touches a release comes from a user's generator or seed: whoever knows it
    can reproduce the draws (and remove noise, or predict masks and batches)."""


def entropy_seeded_generator(device: DeviceLike = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` whose state is drawn from OS entropy (``os.urandom``).

    On the CPU the generator is torch's MT19937 (Matsumoto & Nishimura 1998) and its full state —
    624 words of 32 bits, 19,968 bits — is written from OS entropy. If this torch's state layout is
    not the one :func:`mt19937_template` checks, it falls back to ``manual_seed`` of 64 random bits,
    with a warning (torch then keeps 32 of them). On other devices (CUDA's Philox) ``manual_seed``
    keeps all 64 bits, so the seed is 64 bits from ``secrets``.
    """
    device = torch.device(device)
    if device.type == "cpu":
        template = mt19937_template()
        if template is not None:
            raw = torch.frombuffer(bytearray(os.urandom(4 * MT_N)), dtype=torch.int32)
            return generator_from_words(template, raw.to(torch.int64) & 0xFFFFFFFF)
        warnings.warn(
            "this torch's CPU generator state has an unknown layout: the generator is seeded by "
            "manual_seed, of which torch keeps 32 bits only; use secure_mode=True for noise "
            "that cannot be predicted.", RuntimeWarning, stacklevel=2)
    return torch.Generator(device=device).manual_seed(secrets.randbits(64))


def secret_generator(given: Any, device: DeviceLike, what: str,
                     stacklevel: int = 2) -> torch.Generator:
    """The generator for a private draw on ``device``: the policy of the whole library.

    * ``given=None``: :func:`entropy_seeded_generator` (secret, full entropy) — the default
      everywhere;
    * a ``torch.Generator``: used as given (on another device: :func:`derived_generator` of it);
    * an integer seed: a generator whose full state is SHAKE-256 of the seed (all its bits count;
      ``manual_seed`` would keep 32 on the CPU);
    * a ``numpy.random.Generator``: 256 bits drawn from it key the state the same way.

    Anything but None warns once with :class:`ReproducibleRandomnessWarning`, naming ``what``
    (e.g. "the noise of DPLeastSquares"): it is reproducible by whoever knows the seed.
    """
    if given is None:
        return entropy_seeded_generator(device)
    if isinstance(given, torch.Generator):
        generator = derived_generator(given, device)
    elif isinstance(given, numbers.Integral) and not isinstance(given, bool):
        generator = seeded_generator(int(given), device)
    elif type(given).__module__.startswith("numpy") and hasattr(given, "integers"):
        key = int.from_bytes(bytes(given.integers(0, 256, 32, dtype="uint8").tolist()), "little")
        generator = seeded_generator(key, device)
    else:
        raise TypeError(f"{what}: expected None (secret randomness from OS entropy), a "
                        f"torch.Generator, an int or a numpy Generator, got "
                        f"{type(given).__name__}.")
    warnings.warn(
        f"{what} is reproducible from the generator or seed given; anyone who knows it can "
        f"reproduce the draws (leave it None for secret randomness from OS entropy).",
        ReproducibleRandomnessWarning, stacklevel=stacklevel + 1)
    return generator


def seeded_generator(seed: int, device: DeviceLike = "cpu") -> torch.Generator:
    """A generator on ``device`` keyed by every bit of the integer ``seed`` (reproducible, not
    secret): on the CPU a full MT19937 state ``SHAKE-256(tag‖seed)``, elsewhere a 64-bit key from
    the same stream."""
    if seed < 0:
        raise ValueError(f"a seed must be ≥ 0, got {seed}.")
    raw = seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "little")
    stream = hashlib.shake_256(_SEED_DOMAIN + len(raw).to_bytes(8, "little") + raw)
    device = torch.device(device)
    template = mt19937_template() if device.type == "cpu" else None
    if template is not None:
        words = torch.frombuffer(bytearray(stream.digest(4 * MT_N)), dtype=torch.int32)
        return generator_from_words(template, words.to(torch.int64) & 0xFFFFFFFF)
    key = int.from_bytes(stream.digest(8), "little")
    return torch.Generator(device=device).manual_seed(key)


def keyed_by_state(generator: torch.Generator) -> torch.Generator:
    """A CPU generator keyed by SHA-256 of ``generator``'s state, without drawing from it (its own
    draws are unchanged): a second stream reproducible from a user's generator, independent of
    the first."""
    digest = hashlib.sha256(bytes(generator.get_state().tolist())).digest()
    return seeded_generator(int.from_bytes(digest, "little"), "cpu")


def derived_generator(generator: Optional[torch.Generator],
                      device: DeviceLike) -> Optional[torch.Generator]:
    """``generator`` if it lives on ``device`` (or is None); else a generator on ``device`` keyed
    from ``generator``'s draws, so that several devices draw from one generator.

    A CPU target gets a full MT19937 state (624 words of 32 bits drawn from ``generator``), another
    device a 64-bit seed (two 32-bit draws). The parent advances; the result is reproducible from
    it.
    """
    device = torch.device(device)
    if generator is None or _same_device(generator.device, device):
        return generator
    template = mt19937_template() if device.type == "cpu" else None
    count = MT_N if template is not None else 2
    words = torch.randint(0, 1 << 32, (count,), generator=generator, dtype=torch.int64,
                          device=generator.device).cpu()
    if template is not None:
        return generator_from_words(template, words)
    return torch.Generator(device=device).manual_seed(int(words[0]) << 32 | int(words[1]))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, a missing index read as the current one."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device()
        index_a = current if a.index is None else a.index
        return index_a == (current if b.index is None else b.index)
    return a.index == b.index or a.index is None or b.index is None


# -- torch's CPU MT19937 state -------------------------------------------------------------------
def generator_from_words(template: torch.Tensor, words: torch.Tensor) -> torch.Generator:
    """A CPU generator whose MT19937 state is ``words`` (624 values < 2³²), positioned so that its
    next draw twists the state first (``left = 1``, ``next = 0``: what a freshly seeded generator
    holds)."""
    state = template.clone()
    state[_WORDS : _WORDS + 8 * MT_N] = words.view(torch.uint8)
    g = torch.Generator()
    g.set_state(state)
    return g


def mt19937_template() -> Optional[torch.Tensor]:
    """A freshly seeded CPU generator's state, if its layout is the expected one; else None. The
    check: the state words of ``manual_seed(5489)`` are MT19937's initialisation, ``left``/``next``
    are 1/0, no cached normal sample; a generator given words W by :func:`generator_from_words`
    twists W as Python's ``random`` (MT19937) does; and the words of seed 5489 written by hand draw
    what ``manual_seed(5489)`` draws."""
    global _template, _checked
    with _lock:
        if _checked:
            return _template
        _checked = True
        try:
            _template = _verified_template()
        except Exception:  # noqa: BLE001 - any surprise means: do not write states, draw serially
            _template = None
        return _template


def _verified_template() -> Optional[torch.Tensor]:
    if sys.byteorder != "little":
        return None
    g = torch.Generator()
    g.manual_seed(5489)
    state = g.get_state()
    if state.dtype != torch.uint8 or state.numel() != _STATE_BYTES:
        return None
    words = state[_WORDS : _WORDS + 8 * MT_N].view(torch.int64).tolist()
    if words != mt_init(5489):
        return None
    if (
        state[_LEFT : _LEFT + 4].view(torch.int32).item() != 1
        or state[_NEXT : _NEXT + 8].view(torch.int64).item() != 0
        or state[_NORMAL_VALID : _NORMAL_VALID + 4].view(torch.int32).item() != 0
        or state[_FLOAT_NORMAL_VALID].item() != 0
    ):
        return None
    # words written by generator_from_words are the MT19937 state: its next draw twists them as
    # Python's MT19937 does, and the initialisation of 5489 written by hand draws what
    # manual_seed(5489) draws
    probe = [(2654435761 * (i + 1)) & 0xFFFFFFFF for i in range(MT_N)]
    mine = generator_from_words(state, torch.tensor(probe, dtype=torch.int64))
    torch.randint(0, 2, (1,), generator=mine)
    reference = random.Random()
    reference.setstate((3, tuple(probe) + (MT_N,), None))
    reference.getrandbits(32)
    if mine.get_state()[_WORDS : _WORDS + 8 * MT_N].view(torch.int64).tolist() != list(
        reference.getstate()[1][:MT_N]
    ):
        return None
    seeded = torch.Generator()
    seeded.manual_seed(5489)
    written = generator_from_words(state, torch.tensor(mt_init(5489), dtype=torch.int64))
    if not torch.equal(torch.randn(1000, generator=seeded), torch.randn(1000, generator=written)):
        return None
    return state


def mt_init(seed: int) -> List[int]:
    """MT19937's state after ``init_genrand(seed)`` (Matsumoto & Nishimura 1998)."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, MT_N):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    return mt


def is_mt19937(g: torch.Generator) -> bool:
    """A CPU generator whose state has the size of torch's own MT19937 state (not, e.g., a
    CSPRNG's)."""
    if g.device.type != "cpu":
        return False
    try:
        return g.get_state().numel() == _STATE_BYTES
    except Exception:  # noqa: BLE001 - a generator without a readable state is not ours to split
        return False


# -- the model's own randomness ------------------------------------------------------------------
class SecretModelRandomness:
    """Draws the randomness of a private step's forward and loss (dropout, stochastic depth,
    anything that reads torch's default generators) from a secret generator.

    Scripts seed torch's global generator publicly (``torch.manual_seed(0)``) for reproducible
    initialisation and data order; dropout masks drawn from it would be known to whoever knows the
    seed, and they are drawn position by position over the batch, so one sample's presence shifts
    every later sample's mask. With secret masks drawn afresh for every step, the honest samples'
    masks are independent of the data and identically distributed with or without any one sample:
    conditioned on the masks the step is the Gaussian mechanism on per-sample clipped gradients,
    so the guarantee holds for the mixture over masks too (each sample's mask is a secret random
    input of its own loss, like a random augmentation).

    ``install()`` registers a forward pre-hook on ``model`` and on each of its submodules: the
    first forward with grad enabled — the model's, or a submodule's that a loop calls directly,
    in training or in eval mode — swaps torch's CPU default generator (and the CUDA default
    generator of every device the model's parameters live on) for a state keyed from the secret
    generator (a full MT19937 state on the CPU, a 64-bit Philox key on CUDA). The user's states
    come back at :meth:`end` — when the engine takes the step's loss, so that randomness the loss
    draws from torch's generators is secret too —, at a forward without grad, or when a forward
    raises; the user's own draws (data order, augmentation) then continue as if the step had
    drawn nothing.
    Every later forward of the model before that draws a fresh secret state (a step whose loss
    raised leaves none of the user's public state in the generators; the user's states saved at
    the first swap come back at the next :meth:`end`). Activation checkpointing replays the
    forward with the state it saved, the secret one.
    """

    def __init__(self, model, generator: Optional[torch.Generator] = None):
        self.model = model
        self.generator = generator if generator is not None else entropy_seeded_generator("cpu")
        self._saved: Optional[tuple] = None
        self._handles: list = []
        self._cuda: Optional[List[torch.device]] = None

    def install(self) -> "SecretModelRandomness":
        """Register the hooks (again after :meth:`remove`); returns self."""
        if not self._handles:
            self._handles = [m.register_forward_pre_hook(self._pre, prepend=True)
                             for m in self.model.modules()]
            self._handles.append(self.model.register_forward_hook(self._post, always_call=True))
        return self

    def remove(self) -> None:
        """Remove the hooks (and put back the user's states if they are still swapped out)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.end()

    def _devices(self) -> List[torch.device]:
        """The CUDA devices of the model's parameters (read once: a model moved after the engine
        was built is refused by the engine's own device checks)."""
        if self._cuda is None:
            devices = {p.device for p in self.model.parameters() if p.device.type == "cuda"}
            self._cuda = sorted(devices, key=lambda d: -1 if d.index is None else d.index)
        return self._cuda

    def _pre(self, module, args) -> None:
        if torch._C._functorch.maybe_current_level() is not None:
            return None  # a torch.func transform replays a module (the fallback): not a step
        if not torch.is_grad_enabled():
            if module is self.model:
                self.end()  # an evaluation forward draws from the user's generators
            return None
        if self._saved is None:
            self._swap()  # a forward with grad, in training or eval mode, may feed a step
        elif module is self.model:
            self._reswap()  # a new forward while a step is open (its loss never came): fresh
        return None

    def _reswap(self) -> None:
        """A fresh secret state over the one in use, keeping the user's states saved at the first
        swap (a step whose loss failed leaves no public state in the generators)."""
        saved, self._saved = self._saved, None
        self._swap()
        self._saved = saved

    def _swap(self) -> None:
        saved = [("cpu", None, torch.default_generator.get_state())]
        template = mt19937_template()
        if template is not None:
            words = torch.randint(0, 1 << 32, (MT_N,), generator=self.generator,
                                  dtype=torch.int64)
            torch.default_generator.set_state(
                generator_from_words(template, words).get_state())
        else:
            torch.default_generator.manual_seed(
                int(torch.randint(0, 1 << 62, (1,), generator=self.generator)))
        for device in self._devices():
            cuda = torch.cuda.default_generators[device.index or torch.cuda.current_device()]
            saved.append(("cuda", cuda, cuda.get_state()))
            words = torch.randint(0, 1 << 32, (2,), generator=self.generator, dtype=torch.int64)
            cuda.manual_seed(int(words[0]) << 32 | int(words[1]))
        self._saved = tuple(saved)

    def _post(self, module, args, output) -> None:
        if sys.exc_info()[0] is not None:
            self.end()  # the forward raised: no loss of this step will come
        return None

    def end(self) -> None:
        """Put the user's generator states back (the step's forward and loss are over)."""
        saved, self._saved = self._saved, None
        for kind, gen, state in saved or ():
            (torch.default_generator if kind == "cpu" else gen).set_state(state)
