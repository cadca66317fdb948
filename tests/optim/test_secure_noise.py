"""private_engine.optim.noise: the engine's noise is never reproducible from a public seed unless
the user asks for it (and is warned), secure_mode draws N(0, std²) from the OS generator, and the
example seeds neither the noise nor the Poisson sampler.

The attack these tests rule out (dummy-record subtraction): re-run the training with the same seed
on a dataset where the private record is replaced by a dummy; if the noise is the same, the
difference of the two updates is the difference of the two clipped gradients, without noise.
"""
import importlib.util
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from private_engine.foundation import randomness
from private_engine.optim import noise
from private_engine.optim.noise import ReproducibleNoiseWarning

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
SIGMA, R = 1.0, 1.0



def _data(target: bool):
    """Seven public samples and either the private record or a dummy in its place."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 20, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (8,), generator=g)
    if not target:
        x[-1], y[-1] = 0.0, 0
    return x, y


def _released_update(target: bool, noise_multiplier: float = SIGMA,
                     **engine_kwargs) -> torch.Tensor:
    """What one run publishes: θ₀ − θ₁ = ĝ after one SGD step (lr 1), everything seeded by 0."""
    torch.manual_seed(0)
    model = nn.Linear(20, 5).double()
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=80, max_grad_norm=R,
                              noise_multiplier=noise_multiplier, **engine_kwargs)
    opt = pe.optim.DPSGD(model.parameters(), lr=1.0, privacy_engine=engine)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    x, y = _data(target)
    opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))
    return before - torch.cat([p.detach().flatten() for p in model.parameters()])


def test_dummy_record_subtraction_fails_with_the_default_noise():
    """Two runs seeded by torch.manual_seed(0), private record vs dummy: the difference of the
    releases is the clipped-gradient difference plus the difference of two independent noises
    (norm ≈ σR√(2d)/B), not the clipped-gradient difference alone."""
    signal = _released_update(True, 0.0) - _released_update(False, 0.0)
    assert signal.norm() > 1e-3  # the records differ: there is something to hide
    residual = (_released_update(True) - _released_update(False)) - signal
    d = signal.numel()
    expected = SIGMA * R * math.sqrt(2 * d) / 8
    # ‖residual‖/expected is a chi with 2d = 210 degrees of freedom over its scale: below 0.5 has
    # probability < 1e-40
    assert residual.norm() > 0.5 * expected, (residual.norm(), expected)


def test_default_generator_is_fresh_full_entropy_on_the_parameters_device():
    torch.manual_seed(0)
    a = pe.PrivacyEngine(nn.Linear(3, 2), batch_size=2, sample_size=20, max_grad_norm=R,
                         noise_multiplier=SIGMA)
    torch.manual_seed(0)
    b = pe.PrivacyEngine(nn.Linear(3, 2), batch_size=2, sample_size=20, max_grad_norm=R,
                         noise_multiplier=SIGMA)
    for engine in (a, b):
        g = engine.noise_generator
        assert isinstance(g, torch.Generator) and g is not torch.default_generator
        assert g.device == engine.params[0].device and not engine.secure_mode
    words_a, words_b = (_mt_words(e.noise_generator) for e in (a, b))
    assert words_a != words_b
    for words in (words_a, words_b):
        # not manual_seed(s) for any s: its words follow MT19937's initialisation recursion from
        # word 0 (only 32 bits of entropy); a full random state breaks it (chance 2⁻³²)
        assert words != randomness.mt_init(words[0])
        assert words[1] != (1812433253 * (words[0] ^ (words[0] >> 30)) + 1) & 0xFFFFFFFF
    assert not torch.equal(torch.randn(8, generator=a.noise_generator),
                           torch.randn(8, generator=b.noise_generator))


def _mt_words(g: torch.Generator):
    state = g.get_state()
    words = state[randomness._WORDS:randomness._WORDS + 8 * randomness.MT_N]
    return words.view(torch.int64).tolist()


def test_entropy_seeded_generators_are_independent_of_torch_seed():
    torch.manual_seed(0)
    first = torch.randn(1000, generator=noise.entropy_seeded_generator())
    torch.manual_seed(0)
    second = torch.randn(1000, generator=noise.entropy_seeded_generator("cpu"))
    assert not torch.equal(first, second)
    assert abs(first.std().item() - 1) < 6 / math.sqrt(2000)  # still a working normal draw


def test_user_generator_warns_once_per_engine_and_is_reproducible():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _released_update(True, noise_generator=torch.Generator().manual_seed(3))
        second = _released_update(True, noise_generator=torch.Generator().manual_seed(3))
    mine = [w for w in caught if issubclass(w.category, ReproducibleNoiseWarning)]
    assert len(mine) == 2  # one per engine (construction), none from the steps
    assert "anyone who knows its seed can remove it" in str(mine[0].message)
    assert mine[0].filename == __file__  # points at the caller's PrivacyEngine(...) line
    assert torch.equal(first, second)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _released_update(True)
    assert not [w for w in caught if issubclass(w.category, ReproducibleNoiseWarning)]


def _check_normal(z: torch.Tensor, std: float):
    """N(0, std²) at six standard errors (or a Kolmogorov–Smirnov p-value below 1e-9): a correct
    sampler fails with probability < 1e-8, a wrong variance, mean or shape does not pass."""
    n = z.numel()
    z = z.double() / std
    assert torch.isfinite(z).all()
    assert abs(z.mean().item()) < 6 / math.sqrt(n), z.mean()
    assert abs(z.var().item() - 1) < 6 * math.sqrt(2 / n), z.var()
    assert abs(z.pow(4).mean().item() - 3) < 6 * math.sqrt(96 / n), z.pow(4).mean()  # E z⁸ = 105
    inside = (z.abs() < 1).double().mean().item()
    assert abs(inside - 0.682689) < 6 * math.sqrt(0.682689 * 0.317311 / n), inside
    s = z.sort().values
    cdf = torch.special.ndtr(s)
    k = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = max((k - cdf).abs().max().item(), (cdf - (k - 1 / n)).abs().max().item())
    assert ks < 3.3 / math.sqrt(n), ks  # P(KS > 3.3/√n) ≈ 2e^{-21.8} < 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_secure_noise_is_normal_with_the_right_std(dtype):
    t = torch.full((1 << 20,), float("nan"), dtype=dtype)
    out = noise.gaussian_noise_(t, 2.5, secure_mode=True)
    assert out is t
    _check_normal(t, 2.5)


def test_secure_draws_sum_four_box_muller_normals(monkeypatch):
    """Each coordinate is (z₁ + z₂ + z₃ + z₄)/2 of four independent draws (Holohan & Braghin)."""
    calls = []
    real = noise._os_standard_normal

    def spy(n, device):
        z = real(n, device)
        calls.append(z)
        return z

    monkeypatch.setattr(noise, "_os_standard_normal", spy)
    monkeypatch.setattr(noise, "SECURE_CHUNK", 1000)
    t = noise.secure_normal_(torch.empty(2500, dtype=torch.float64), 3.0)
    assert [z.numel() for z in calls] == [4000, 4000, 2000]
    expected = torch.cat([z.view(4, -1).sum(0) for z in calls]) * 1.5
    assert torch.allclose(t, expected, rtol=1e-15, atol=0)
    strided = torch.empty(6, 4, dtype=torch.float64).t()  # not contiguous: filled through a copy
    noise.secure_normal_(strided, 1.0)
    assert torch.isfinite(strided).all() and strided.std() > 0


def test_secure_noise_ignores_torch_seed_and_refuses_a_generator():
    torch.manual_seed(0)
    a = noise.gaussian_noise_(torch.empty(64), 1.0, secure_mode=True)
    torch.manual_seed(0)
    b = noise.gaussian_noise_(torch.empty(64), 1.0, secure_mode=True)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="generator=None"):
        noise.gaussian_noise_(torch.empty(4), 1.0, torch.Generator(), secure_mode=True)
    with pytest.raises(ValueError, match="one or the other"):
        pe.PrivacyEngine(nn.Linear(3, 2), batch_size=2, sample_size=20, max_grad_norm=R,
                         noise_multiplier=SIGMA, secure_mode=True,
                         noise_generator=torch.Generator().manual_seed(0))


def test_engine_secure_mode_adds_secure_noise_of_std_sigma_r(monkeypatch):
    """A loss with zero gradient: the SGD update is the noise over B, drawn by secure_normal_."""
    drawn = []
    real = noise.secure_normal_
    monkeypatch.setattr(noise, "secure_normal_", lambda t, std: drawn.append(std) or real(t, std))
    model = nn.Linear(300, 300)
    sigma, r, batch = 1.3, 0.7, 4
    engine = pe.PrivacyEngine(model, batch_size=batch, sample_size=40, max_grad_norm=r,
                              noise_multiplier=sigma, secure_mode=True)
    assert engine.secure_mode and engine.noise_generator is None
    opt = pe.optim.DPSGD(model.parameters(), lr=1.0, privacy_engine=engine)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt.step(loss=(model(torch.randn(batch, 300)) * 0).sum(1))
    update = before - torch.cat([p.detach().flatten() for p in model.parameters()])
    assert drawn == [pytest.approx(sigma * r)]
    n = update.numel()
    z = update.double() * batch / (sigma * r)
    assert abs(z.mean().item()) < 6 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 6 * math.sqrt(2 / n)


def test_a_generator_on_another_device_keys_a_full_state_one(monkeypatch):
    """The derivation used when the generator and the tensor are on different devices, exercised on
    the CPU: a full MT19937 state from the parent's draws, reproducible from the parent."""
    parent = torch.Generator().manual_seed(5)
    assert noise.generator_on(parent, "cpu") is parent and noise.generator_on(None, "cpu") is None
    monkeypatch.setattr(randomness, "_same_device", lambda a, b: False)
    derived = noise.generator_on(parent, "cpu")
    again = noise.generator_on(torch.Generator().manual_seed(5), "cpu")
    assert derived is not parent and torch.equal(derived.get_state(), again.get_state())
    words = _mt_words(derived)
    assert words[1] != (1812433253 * (words[0] ^ (words[0] >> 30)) + 1) & 0xFFFFFFFF


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_generator_lives_on_the_cuda_parameters():
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(pe.PrivacyEngine(nn.Linear(3, 2).cuda(), batch_size=2, sample_size=20,
                                        max_grad_norm=R, noise_multiplier=SIGMA))
    gens = [e.noise_generator for e in engines]
    assert all(g.device.type == "cuda" for g in gens)
    draws = [torch.randn(16, device="cuda", generator=g) for g in gens]
    assert not torch.equal(*draws)
    buffers = [torch.zeros(10, device="cuda")]
    pe.optim.add_gaussian_noise(buffers, 1.0, None, secure_mode=True)
    assert buffers[0].is_cuda and buffers[0].std() > 0


# -- the example ---------------------------------------------------------------------------------
def _load_example():
    spec = importlib.util.spec_from_file_location(
        "finetune_timm_vit", ROOT / "examples" / "finetune_timm_vit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Stop(Exception):
    pass


def test_example_seeds_neither_the_noise_nor_the_poisson_sampler(monkeypatch):
    """--seed 0 twice: the sampler's generators differ (and are not manual_seed(0)'s), and the
    engine gets no noise_generator (so it seeds its own from OS entropy)."""
    example = _load_example()
    samplers, engine_kwargs = [], []
    real_loader = example.poisson_loader

    def loader(dataset, batch_size, generator=None, **kwargs):
        samplers.append(generator)
        return real_loader(dataset, batch_size, generator=generator, **kwargs)

    def engine(model, **kwargs):
        engine_kwargs.append(kwargs)
        raise _Stop

    monkeypatch.setattr(example, "poisson_loader", loader)
    monkeypatch.setattr(example.pe, "PrivacyEngine", engine)
    for _ in range(2):
        with pytest.raises(_Stop):
            example.main(["--seed", "0", "--depth", "1", "--epochs", "1"])
    public = torch.Generator().manual_seed(0).get_state()
    assert all(isinstance(g, torch.Generator) for g in samplers)
    assert not torch.equal(samplers[0].get_state(), samplers[1].get_state())
    assert not any(torch.equal(g.get_state(), public) for g in samplers)
    assert all(kw.get("noise_generator") is None and not kw.get("secure_mode")
               for kw in engine_kwargs)
