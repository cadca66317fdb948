"""nn.LayerNorm (multi-dim normalized_shape, elementwise_affine, bias=False), nn.GroupNorm and
timm's LayerNorm / GroupNorm subclasses: every mode × every clip function."""
import math

import pytest
import torch
from torch import nn

from engine_checks import CLIPS, MODES, check_against_reference, gen_for, rng_for, target_like

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = range(3)


def _randomize_affine(module: nn.Module, seed: int) -> None:
    """Affine params away from (1, 0), so that mistakes in x̂ or in g show."""
    gen = gen_for(seed + 100)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


def layernorm_case(seed: int, affine: bool, bias: bool, norm_cls=nn.LayerNorm):
    rng = rng_for("layernorm", seed, affine, bias, norm_cls.__name__)
    B = rng.randint(3, 5)
    rank = rng.randint(2, 4)  # input (B, *rest)
    rest = [rng.randint(2, 4) for _ in range(rank - 1)]
    n_norm = rng.randint(1, min(2, rank - 1))
    normalized_shape = tuple(rest[-n_norm:])
    torch.manual_seed(seed)
    # timm's LayerNorm(num_channels, eps, affine, **kwargs) names the flag differently
    kwargs = {"elementwise_affine" if norm_cls is nn.LayerNorm else "affine": affine, "bias": bias}
    norm = norm_cls(normalized_shape if n_norm > 1 else normalized_shape[0], **kwargs)
    _randomize_affine(norm, seed)
    d0 = rng.randint(1, 4)
    if seed % 2 or not affine:  # a trainable Linear before it (required when LN has no params)
        model = nn.Sequential(nn.Linear(d0, rest[-1]), norm)
        x_shape = (B, *rest[:-1], d0)
    else:
        model = nn.Sequential(norm)
        x_shape = (B, *rest)
    model = model.double()
    gen = gen_for(seed)
    x = torch.randn(*x_shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    return model, [x, target_like(model, x, gen)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)],
                         ids=["affine", "no_bias", "no_affine"])
def test_layernorm_matches_reference(affine, bias, mode, clip, seed):
    model, inputs = layernorm_case(seed, affine, bias)
    check_against_reference(model, inputs, mode=mode, clip=clip)


def groupnorm_case(seed: int, affine: bool, norm_factory=None):
    rng = rng_for("groupnorm", seed, affine)
    B = rng.randint(3, 5)
    groups = rng.randint(1, 3)
    spatial = [rng.randint(1, 4) for _ in range(rng.randint(0, 2))]
    per_group = rng.randint(1, 3)
    if per_group * math.prod(spatial) == 1:  # GroupNorm needs more than one value per group
        per_group = 2
    C = groups * per_group
    torch.manual_seed(seed)
    norm = (norm_factory or nn.GroupNorm)(groups, C, affine=affine)
    _randomize_affine(norm, seed)
    c0 = rng.randint(1, 3)
    # no bias before GroupNorm: with one channel per group the norm removes it (a gradient of
    # ~1e-17)
    if not spatial:
        pre = nn.Linear(c0, C, bias=False)
    else:
        pre = {1: nn.Conv1d, 2: nn.Conv2d}[len(spatial)](c0, C, 1, bias=False)
    if seed % 2 or not affine:
        model = nn.Sequential(pre, norm)
        x_shape = (B, c0, *spatial)
    else:
        model = nn.Sequential(norm)
        x_shape = (B, C, *spatial)
    model = model.double()
    gen = gen_for(seed)
    x = torch.randn(*x_shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    return model, [x, target_like(model, x, gen)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
def test_groupnorm_matches_reference(affine, mode, clip, seed):
    model, inputs = groupnorm_case(seed, affine)
    check_against_reference(model, inputs, mode=mode, clip=clip)


# -- timm subclasses with the same math (the rule is found along the class hierarchy) ---------
timm_layers = pytest.importorskip("timm.layers")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_timm_layernorm_subclass(mode, seed):
    assert issubclass(timm_layers.LayerNorm, nn.LayerNorm)
    for clip, bias in zip(CLIPS, [True, False, True, False]):
        model, inputs = layernorm_case(seed, True, bias, norm_cls=timm_layers.LayerNorm)
        assert type(model[-1]) is timm_layers.LayerNorm
        check_against_reference(model, inputs, mode=mode, clip=clip)


@pytest.mark.parametrize("factory", ["GroupNorm", "GroupNorm1"])
@pytest.mark.parametrize("mode", MODES)
def test_timm_groupnorm_subclasses(mode, factory):
    cls = getattr(timm_layers, factory)
    # timm's GroupNorm(num_channels, num_groups) / GroupNorm1(num_channels) put channels first
    make = ((lambda g, c, affine: cls(c, g, affine=affine)) if factory == "GroupNorm"
            else (lambda g, c, affine: cls(c, affine=affine)))
    for seed in SEEDS:
        model, inputs = groupnorm_case(seed, True, norm_factory=make)
        check_against_reference(model, inputs, mode=mode, clip="abadi")


def test_sum_per_sample_terms():
    """Per-layer squared norms are summed once, in the widest dtype; none gives zeros of the batch
    size."""
    from private_engine.layers.base import sum_per_sample

    like = torch.zeros(3, 5)
    assert torch.equal(sum_per_sample([], like), torch.zeros(3))
    terms = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64),
             torch.tensor([1.0, 0.0, 2.0])]
    for k in (1, 2, 3):
        got = sum_per_sample(terms[:k], like)
        want = sum(t.double() for t in terms[:k])
        assert got.dtype == (torch.float32 if k == 1 else torch.float64)
        torch.testing.assert_close(got.double(), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 13])
def test_gram_inner_with_bias_column_on_padded_rows(monkeypatch, dtype, T):
    """``gram_inner(a, g, bias=True) = ⟨aaᵀ + 11ᵀ, ggᵀ⟩ = ‖gᵀa‖² + ‖gᵀ1‖²`` (weight and bias norms
    in one Gram), also when the rows are zero-padded as on CUDA (padding forced here on the CPU):
    the padded rows of g are zero, so the 1s added on the padded rows of aaᵀ contribute nothing."""
    import private_engine.layers.base as base

    gen = gen_for(T)
    a = torch.randn(4, T, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(4, T, 3, generator=gen, dtype=torch.float64)
    weight = torch.einsum("btp,btd->bpd", g, a).pow(2).sum((1, 2))
    bias = g.sum(1).pow(2).sum(1)
    tol = dict(rtol=1e-12, atol=0) if dtype == torch.float64 else dict(rtol=3e-2, atol=0)
    for pad in (False, True):
        if pad:
            monkeypatch.setattr(base, "aligned_positions",
                                lambda t: torch.nn.functional.pad(t, (0, 0, 0, 8 - t.shape[1] % 8)))
        got = base.gram_inner(a.to(dtype), g.to(dtype), bias=True)
        assert got.dtype == torch.float64  # certified norms are summed in float64
        torch.testing.assert_close(got.double(), weight + bias, **tol)
        torch.testing.assert_close(base.gram_inner(a.to(dtype), g.to(dtype)).double(), weight,
                                   **tol)


def test_unit_weight_is_a_cached_plain_vector_of_ones():
    """x̂ is computed by layer_norm/group_norm with γ = 1 (faster CPU kernels than γ = None); the
    cached ones must be a normal tensor even when first made under inference mode, shared, and left
    at one after a step."""
    from private_engine.layers.normalization import _UNIT_WEIGHTS, unit_weight

    like = torch.zeros(2, dtype=torch.float64)
    _UNIT_WEIGHTS.pop(((7,), torch.float64, like.device), None)
    with torch.inference_mode():
        w = unit_weight((7,), like)
    assert not w.is_inference() and not w.requires_grad
    assert w.dtype == torch.float64 and torch.equal(w, torch.ones(7, dtype=torch.float64))
    assert unit_weight(torch.Size([7]), like) is w and unit_weight((1, 7), like).shape == (1, 7)
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    assert torch.allclose(nn.functional.layer_norm(x, (7,), w, None, 1e-5),
                          nn.functional.layer_norm(x, (7,), None, None, 1e-5), atol=1e-12, rtol=0)

    import private_engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GroupNorm(2, 6))
    engine = private_engine.PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0,
                                          noise_multiplier=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    opt.step(loss=model(torch.randn(3, 4)).pow(2).sum(1))
    assert torch.equal(unit_weight((6,), torch.zeros(1)), torch.ones(6))
