"""Checkpoints against an adversary who sees every released iterate and every checkpoint, those of
a run killed after its checkpoint and of the run resumed from it included (in one process: the
killed run is an engine that went on after its checkpoint; the resumed one a new engine on a new
model, as a new process builds).

* the resumed run's noise is fresh: the killed and the resumed run's iterates one SGD step after
  the checkpoint differ by two independent draws (std √2·lr·σR/B per coordinate), not by the tiny
  data term alone, as they would if the killed run's noise were drawn again;
* ε after the resume counts every step the killed run released;
* the file holds no generator state, no un-noised sum, no data-dependent counter.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import private_engine as pe
from private_engine.data import poisson_loader
from private_engine.foundation.randomness import is_mt19937

pytestmark = pytest.mark.usefixtures("one_thread")

N, D_IN, D_OUT, B, SIGMA, R, LR = 256, 32, 16, 32, 1.0, 1.0, 0.5




def _data():
    gen = torch.Generator().manual_seed(0)
    # inputs of size 1e-4 and no bias: the clipped gradients are ~1e-4, the noise ~1
    x = 1e-4 * torch.randn(N, D_IN, generator=gen)
    return TensorDataset(x, torch.randint(0, D_OUT, (N,), generator=gen))


def _build(**kwargs):
    torch.manual_seed(1)  # the public initialisation
    model = nn.Linear(D_IN, D_OUT, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=R,
                              noise_multiplier=SIGMA, **kwargs)
    engine.attach(opt)
    return model, opt, engine


def _train(model, opt, engine, steps, data, seen, save=None, save_at=None):
    """``steps`` Poisson logical batches from a fresh default loader (a new process's); the
    iterate after each goes to ``seen`` (what an observer records)."""
    batches = iter(poisson_loader(data, B))
    for _ in range(steps):
        x, y = next(batches)
        opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))
        seen.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        if save is not None and len(seen) == save_at:
            pe.save_checkpoint(save, model=model, optimizer=opt, engine=engine)


def _killed_and_resumed(tmp_path, **kwargs):
    """The killed run: 6 steps, checkpoint after the 3rd. The resumed run: from the checkpoint,
    3 steps. Returns both runs' iterates, the killed run's engine and the resumed run's engine
    right after loading (its ε then) and at the end."""
    data, path = _data(), tmp_path / "ckpt.pt"
    killed, resumed = [], []
    model, opt, engine = _build(**kwargs)
    _train(model, opt, engine, 6, data, killed, save=path, save_at=3)
    model2, opt2, engine2 = _build(**kwargs)
    pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    loaded = (engine2.steps_taken, engine2.get_epsilon())
    _train(model2, opt2, engine2, 3, data, resumed)
    return killed, resumed, engine, engine2, loaded


def test_resumed_run_draws_fresh_noise(tmp_path):
    """The first step after the checkpoint, in the killed and in the resumed run, starts from the
    same parameters on other Poisson batches. Its difference is the data term (~1e-6 here) plus
    the two runs' noises: replayed noise would cancel; fresh noise gives std √2·lr·σR/B."""
    killed, resumed, *_ = _killed_and_resumed(tmp_path)
    diff = killed[3] - resumed[0]
    scale = math.sqrt(2) * LR * SIGMA * R / B
    ratio = float(diff.square().mean().sqrt()) / scale  # (χ²_d/d)^½, d = 512: sd ≈ 0.03
    assert 0.85 < ratio < 1.15, ratio
    assert abs(float(diff.mean())) < 6 * scale / math.sqrt(diff.numel())


def test_resumed_epsilon_counts_every_step_the_killed_run_released(tmp_path):
    """The killed run released 6 steps, 3 of them after its checkpoint: the resumed engine starts
    at 6 steps and the killed run's ε, and ends at 9 steps."""
    _, _, engine, engine2, (steps_loaded, eps_loaded) = _killed_and_resumed(tmp_path)
    assert engine.steps_taken == 6
    assert steps_loaded == 6
    assert eps_loaded >= engine.get_epsilon() > 0
    assert engine2.steps_taken == 9 and engine2.get_epsilon() > eps_loaded


def test_secure_mode_resume_counts_every_step_too(tmp_path):
    *_, engine, engine2, (steps_loaded, eps_loaded) = _killed_and_resumed(tmp_path,
                                                                          secure_mode=True)
    assert steps_loaded == engine.steps_taken == 6
    assert eps_loaded == engine.get_epsilon()


def _tensors(obj):
    """Every tensor in a nested checkpoint."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _keys(obj, prefix=""):
    """Every dict key path in a nested checkpoint."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{prefix}{k}"
            yield from _keys(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _keys(v, prefix)


def test_checkpoint_holds_no_generator_state_no_accumulation_no_counter(tmp_path):
    """What an adversary reads in the file: no generator state (not the live generator's, nor any
    tensor of the size of an MT19937 state), no clipped sum not yet noised (a save attempted in
    the middle of a logical batch is refused and the file keeps the previous content), no
    dropped-sample count, no sampling-rate totals (sums of the Poisson batch sizes)."""
    data, path = _data(), tmp_path / "ckpt.pt"
    model, opt, engine = _build()
    _train(model, opt, engine, 2, data, [], save=path, save_at=2)
    before = path.read_bytes()
    x, y = data[:40]
    opt.virtual_step(loss=F.cross_entropy(model(x), y, reduction="none"))
    accumulated = [g.clone() for g in engine._attached[0].grad_sums.grads]
    with pytest.raises(ValueError, match="accumulated"):
        pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine)
    assert path.read_bytes() == before
    opt.step(loss=F.cross_entropy(model(x[:8]), y[:8], reduction="none"))

    saved = torch.load(path, weights_only=True)
    assert saved["engine"]["noise_generator"] is None
    state = engine.noise_generator.get_state()
    template = torch.Generator().get_state()
    for t in _tensors(saved):
        assert not (t.dtype == torch.uint8 and t.numel() == template.numel())
        assert not (t.shape == state.shape and torch.equal(t, state))
        for g in accumulated:
            assert not (t.shape == g.shape and torch.allclose(t, g))
    keys = set(_keys(saved))
    for secret in ("accumulation", "sampling_check", "dropped_samples", "overflow_batches",
                   "good_batches"):
        assert not any(k.split(".")[-1] == secret for k in keys), secret
    assert is_mt19937(engine.noise_generator)  # the generator existed: it was not written


def test_generator_given_by_the_user_is_kept_and_warned_about(tmp_path):
    """A noise_generator given by the user makes the run reproducible (warned at construction):
    its state is written so the resumed run continues its stream instead of restarting it."""
    data, path = _data(), tmp_path / "ckpt.pt"
    with pytest.warns(pe.optim.noise.ReproducibleNoiseWarning):
        model, opt, engine = _build(noise_generator=torch.Generator().manual_seed(3))
    _train(model, opt, engine, 1, data, [], save=path, save_at=1)
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["engine"]["noise_generator"], engine.noise_generator.get_state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model2, opt2, engine2 = _build()
    with pytest.raises(ValueError, match="noise_generator"):
        pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    assert engine2.steps_taken == 0
