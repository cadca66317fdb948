"""DP-MAE masks cannot move with the batch, and are secret by default.

The recipe (``dp_mae_train``) is run as shipped, with three collaborators replaced so that its
release can be measured as in tests/privacy/test_privacy_under_attack.py: the engine draws no
noise (σ = 0), the optimizer is an SGD (lr 1 unless a test holds the weights with lr 0) that
records the gradient it consumes, and the Poisson loader yields the batches a test gives. One
sample added to a batch (same other samples, same declared batch size B) must move that release
by at most R/B:

    B·‖ĝ(with) − ĝ(without)‖ / R ≤ 1 + float rounding,

in every clipping mode; a later step on identical data and weights must release the same, however
many samples the earlier batches held. Masks drawn row by row from one seeded generator fail both
(an honest sample's mask shifts with the rows ahead of it, every later step's with the samples
before it). The default masks must be secret and full-entropy: two runs after the same
``torch.manual_seed`` mask differently, and the key comes from the OS.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import private_engine as pe
import private_engine.data
import private_engine.engine
import private_engine.optim
from engine_checks import MODES
from private_engine.foundation.randomness import ReproducibleRandomnessWarning
from private_engine.pretrain import (
    DPMAEConfig,
    KeyedMasks,
    SyntheticConfig,
    SyntheticImages,
    build_mae,
    dp_mae_train,
    pretrain_synthetic,
)

R = 0.1  # max_grad_norm (the paper's C)
B = 32  # declared (expected) logical batch size
PHYSICAL = 16  # physical chunks: the sample at the front shifts every chunk boundary
SEED = 12345  # a user-given mask seed: the masks are reproducible, so the bound is measurable
TOL = 1e-6  # float64 model and data: rounding of the honest sums only

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Optimal order")]


def tiny_mae(seed: int = 0):
    torch.manual_seed(seed)
    return build_mae(img_size=8, patch_size=2, depth=1, embed_dim=16, num_heads=2,
                     decoder_dim=16, decoder_depth=1, decoder_heads=2).double()


def images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def crafted() -> torch.Tensor:
    """An adversarial image: huge pixel values of maximal contrast inside every patch."""
    x = torch.full((1, 3, 8, 8), 1e4, dtype=torch.float64)
    x[..., ::2, :] *= -1
    return x


# -- the recipe with a measurable release -------------------------------------------------------
class ZeroNoiseEngine(pe.PrivacyEngine):
    """The recipe's engine with σ = 0 (no calibration): it releases the clipped sum / B."""

    def __init__(self, model, *, target_epsilon=None, target_delta=None, accountant=None,
                 **kwargs):
        super().__init__(model, noise_multiplier=0.0, **kwargs)


class Interrupted(Exception):
    """The run stopped by :class:`Batches` (a crash between epochs)."""


class Batches:
    """The loader: every epoch yields the logical ``batches``; after ``stop_after`` batches in
    all it raises :class:`Interrupted` instead of yielding the next one."""

    def __init__(self, batches, stop_after=None):
        self.batches, self.stop_after, self.yielded = batches, stop_after, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for x in self.batches:
            if self.yielded == self.stop_after:
                raise Interrupted
            self.yielded += 1
            yield (x,)


def run_recipe(monkeypatch, model, batches, *, mode="bk_mixed", clip="abadi", lr=1.0,
               epochs=1, max_grad_norm=R, stop_after=None, **kwargs):
    """The gradients released at each step of ``dp_mae_train`` on a copy of ``model`` and the
    logical ``batches`` (each epoch yields all of them), noise 0; ``kwargs`` go to
    ``dp_mae_train``."""
    released = []

    class CapturingSGD(torch.optim.SGD):
        def __init__(self, params, *, privacy_engine, **_):
            super().__init__(params, lr=lr)
            privacy_engine.attach(self)

        def step(self, closure=None):
            released.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                             for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    monkeypatch.setattr(private_engine.engine, "PrivacyEngine", ZeroNoiseEngine)
    monkeypatch.setattr(private_engine.optim, "DPAdamW", CapturingSGD)
    monkeypatch.setattr(private_engine.data, "poisson_loader",
                        lambda data, batch_size, **_: Batches(batches, stop_after))
    population = TensorDataset(torch.zeros(8 * B, 3, 8, 8))  # n only: the loader is replaced
    config = DPMAEConfig(epochs=epochs, batch_size=B, physical_batch_size=PHYSICAL,
                         max_grad_norm=max_grad_norm, clipping_mode=mode, clipping_fn=clip)
    dp_mae_train(copy.deepcopy(model), population, config, progress=False, **kwargs)
    return released


def ratio(a, b, max_grad_norm: float = R) -> float:
    """``B·‖a − b‖/R`` over every parameter."""
    return B * math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b))) / max_grad_norm


# -- sensitivity ---------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")
@pytest.mark.parametrize("mode,clip", [(m, "abadi") for m in MODES]
                         + [("bk_mixed", "automatic"), ("bk_mixed", "global")])
def test_a_sample_at_the_front_moves_the_release_by_at_most_R(monkeypatch, mode, clip):
    """One step on 31 honest images with and without the crafted one ahead of them: with masks
    drawn row by row from a seeded generator this measured 1.55 (every mode; 1.10 with global
    clipping). Global clipping keeps a sample whole below R and drops it above: R = 4.4 is just
    above every per-sample norm here (the crafted sample's 4.24 the largest), so every sample
    counts."""
    model = tiny_mae()
    honest = images(B - 1, seed=1)
    bound = 4.4 if clip == "global" else R
    [with_] = run_recipe(monkeypatch, model, [torch.cat([crafted(), honest])], mode=mode,
                         clip=clip, max_grad_norm=bound, mask_seed=SEED)
    [without] = run_recipe(monkeypatch, model, [honest], mode=mode, clip=clip,
                           max_grad_norm=bound, mask_seed=SEED)
    r = ratio(with_, without, bound)
    assert r <= 1 + TOL, r
    assert r > 0.5, r  # the crafted sample counts


@pytest.mark.filterwarnings("ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")
def test_a_later_step_does_not_depend_on_earlier_batch_sizes(monkeypatch):
    """Step 0 on 0, 5 or 20 samples, then step 1 on the same 32 images at the same weights (lr
    0): the same release (masks from one seeded generator advanced by the earlier samples
    moved it by 1.43·R/B)."""
    model = tiny_mae()
    later = images(B, seed=2)
    earlier = images(20, seed=3)
    runs = [run_recipe(monkeypatch, model, [earlier[:k], later], lr=0.0, mask_seed=SEED)
            for k in (0, 5, 20)]
    for run in runs[1:]:
        assert ratio(run[1], runs[0][1]) <= TOL


@pytest.mark.filterwarnings("ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")
def test_the_masks_change_from_step_to_step(monkeypatch):
    """The same images at the same weights, two steps: other masks, another release (a mask
    fixed per image for the whole run would be private too, but a weaker MAE)."""
    later = images(B, seed=2)
    run = run_recipe(monkeypatch, tiny_mae(), [later, later], lr=0.0, mask_seed=SEED)
    assert ratio(run[0], run[1]) > 1e-3


@pytest.mark.filterwarnings("ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")
def test_a_resumed_run_keeps_its_masks(monkeypatch, tmp_path):
    """The key and the step count are restored: epoch 2 of a resumed run releases what epoch 2
    of an uninterrupted run releases (a fresh key would give other masks)."""
    model = tiny_mae()
    batch = [images(B, seed=4)]
    straight = run_recipe(monkeypatch, model, batch, epochs=2, mask_seed=SEED)
    ckpt = str(tmp_path / "dp.pt")
    with pytest.raises(Interrupted):  # stops after epoch 1 and its checkpoint
        run_recipe(monkeypatch, model, batch, epochs=2, mask_seed=SEED, checkpoint=ckpt,
                   stop_after=len(batch))
    resumed = run_recipe(monkeypatch, tiny_mae(seed=9), batch, epochs=2, checkpoint=ckpt,
                         resume=True)  # mask_seed None: the checkpoint's key is used
    assert len(straight) == 2 and len(resumed) == 1
    assert ratio(resumed[0], straight[1]) <= TOL
    saved = torch.load(ckpt, weights_only=True)["extra"]["masks"]
    assert saved.keys() == KeyedMasks(16, seed=SEED).state_dict().keys()
    assert torch.equal(saved["key"], KeyedMasks(16, seed=SEED).state_dict()["key"])


# -- secrecy ---------------------------------------------------------------------------------------
def test_default_masks_are_secret(monkeypatch):
    """Two runs after the same ``torch.manual_seed``, same data and weights, noise 0: the
    releases differ (secret masks), and no ReproducibleRandomnessWarning is raised; with a mask
    seed they are equal, with the warning."""
    model = tiny_mae()
    batch = [images(B, seed=5)]
    releases = []
    for _ in range(2):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            releases.append(run_recipe(monkeypatch, model, batch)[0])
        assert not [w for w in caught if issubclass(w.category, ReproducibleRandomnessWarning)]
    assert ratio(*releases) > 1e-3
    seeded = []
    for _ in range(2):
        with pytest.warns(ReproducibleRandomnessWarning, match="MAE masks"):
            seeded.append(run_recipe(monkeypatch, model, batch, mask_seed=SEED)[0])
    assert ratio(*seeded) <= TOL


def test_synthetic_pretraining_is_secret_by_default():
    """Step 1 reads public images only, but its order and masks are secret by default too: two
    runs after the same ``torch.manual_seed`` train differently; a seed reproduces them."""
    data = SyntheticImages(64, size=8, seed=0)
    config = SyntheticConfig(epochs=1, batch_size=32)

    def weights(**kwargs):
        model = tiny_mae().float()
        torch.manual_seed(0)
        pretrain_synthetic(model, data, config, progress=False, **kwargs)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert not torch.equal(weights(), weights())
    with pytest.warns(ReproducibleRandomnessWarning, match="synthetic pre-training"):
        a = weights(seed=3)
    with pytest.warns(ReproducibleRandomnessWarning):
        assert torch.equal(a, weights(seed=3))


def test_default_key_is_full_entropy_from_the_os(monkeypatch):
    """The default key is 256 bits drawn from a generator whose whole state comes from
    ``os.urandom`` (not torch's global seed, not 32 bits): with ``os.urandom`` fixed two keys
    are equal whatever ``torch.manual_seed`` says, ≥ 256 bits are read; a user seed keeps all
    its bits."""
    x = images(4, seed=6)
    torch.manual_seed(0)
    a = KeyedMasks(16).ids(x, 0)
    torch.manual_seed(0)
    assert not torch.equal(a, KeyedMasks(16).ids(x, 0))
    assert KeyedMasks.KEY_BYTES * 8 >= 256 and KeyedMasks(16).state_dict()["key"].numel() == 32

    requested = []

    def fixed_urandom(n):
        requested.append(n)
        return bytes(range(256)) * (n // 256) + bytes(n % 256)

    monkeypatch.setattr(os, "urandom", fixed_urandom)
    torch.manual_seed(1)
    b = KeyedMasks(16).ids(x, 0)
    torch.manual_seed(2)
    assert torch.equal(b, KeyedMasks(16).ids(x, 0))
    assert sum(requested) >= 2 * 32
    monkeypatch.undo()
    with pytest.warns(ReproducibleRandomnessWarning):
        low, high = KeyedMasks(16, seed=7), KeyedMasks(16, seed=7 + 2 ** 32)
    assert not torch.equal(low.ids(x, 0), high.ids(x, 0))


# -- the masks themselves -------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")
def test_a_sample_mask_reads_its_own_bytes_and_the_step_only():
    masks = KeyedMasks(16, seed=SEED)
    x = images(6, seed=7)
    ids = masks.ids(x, 3)
    assert ids.dtype == torch.int64 and ids.shape == (6, 16)
    assert torch.equal(ids.sort(1).values, torch.arange(16).expand(6, 16))  # permutations
    for k in range(6):  # alone, or behind other samples: the same mask
        assert torch.equal(masks.ids(x[k:k + 1], 3)[0], ids[k])
    assert torch.equal(masks.ids(torch.cat([crafted(), x.flip(0)]), 3)[1:], ids.flip(0))
    assert len({tuple(r[:4].tolist()) for r in ids}) == 6  # samples differ
    assert not torch.equal(masks.ids(x, 4), ids)  # steps differ
    assert not torch.equal(KeyedMasks(16, seed=SEED + 1).ids(x, 3), ids)  # keys differ
    assert masks.ids(x[:0], 3).shape == (0, 16)
    with pytest.raises(ValueError):
        masks.ids(x, -1)


@pytest.mark.filterwarnings("ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")
def test_masks_are_uniform():
    """Each patch is visible in a fraction K/L = 1/4 of the masks (4,000 masks: binomial
    standard deviation 0.007 per patch), and the first visible patch is uniform."""
    masks = KeyedMasks(16, seed=SEED)
    ids = torch.cat([masks.ids(images(500, seed=8), t) for t in range(8)])
    visible = torch.zeros(16)
    visible.index_add_(0, ids[:, :4].flatten(), torch.ones(ids.shape[0] * 4))
    freq = visible / ids.shape[0]
    assert (freq - 0.25).abs().max() < 0.04, freq
    first = torch.bincount(ids[:, 0], minlength=16) / ids.shape[0]
    assert (first - 1 / 16).abs().max() < 0.025, first


def _broadcast_on_rank(rank, out_dir):
    masks = KeyedMasks(16)  # each rank its own secret key
    before = masks.state_dict()["key"]
    masks.broadcast_(torch.device("cpu"))
    return before, masks.state_dict()["key"]


def test_every_rank_takes_rank_0_key(tmp_path):
    """Under ``torch.distributed`` (2 gloo ranks) every rank masks with rank 0's key, so that a
    sample's mask does not depend on the rank it lands on."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    try:  # the spawned ranks import dist_spawn and this module through the parent's sys.path
        from dist_spawn import run_ranks

        (before0, after0), (before1, after1) = run_ranks(_broadcast_on_rank, tmp_path)
    finally:
        sys.path.pop(0)
    assert not torch.equal(before0, before1)
    assert torch.equal(after0, before0) and torch.equal(after1, before0)
