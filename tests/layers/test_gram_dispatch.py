"""The certified norms of Linear and Conv layers form their ghost Grams in float32 for honest
float32 inputs — no float64 matmul is dispatched (on a GPU float64 runs at 1/15 to 1/64 of the
float32 rate) — and only a crafted sample's norm takes float64 Grams; the bounds stay at least
the exact norm and within 10⁻³ of it."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine_checks import gen_for
from private_engine.layers import find_rule

pytestmark = pytest.mark.usefixtures("one_thread")

MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "convolution", "convolution_backward",
           "addbmm", "addmv", "mv", "dot"}


def honest(n, T, D, p, seed):
    gen = gen_for(seed)
    a = torch.randn(n, T, D, generator=gen) + 0.5 * torch.randn(1, 1, D, generator=gen)
    return a, 1e-3 * torch.randn(n, T, p, generator=gen)


def exact_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``‖g_iᵀ (a_i, 1)‖²_F`` per sample in float64."""
    A = torch.cat([a.double(), torch.ones_like(a[..., :1], dtype=torch.float64)], 2)
    return torch.einsum("ntp,ntd->npd", g.double(), A).square().sum((1, 2))


class MatmulDtypes(TorchDispatchMode):
    """Records the dtype of the first operand of every matmul-like kernel."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            first = next(x for x in args if isinstance(x, torch.Tensor))
            self.seen.append((func.overloadpacket.__name__, first.dtype))
        return func(*args, **(kwargs or {}))


def _linear_pairs(kind=None):
    gen = gen_for(5)
    lin = nn.Linear(24, 16)
    if kind is None:
        return lin, [honest(3, 10, 24, 16, 5)]
    a, g = torch.randn(3, 10, 24, generator=gen), torch.randn(3, 10, 16, generator=gen)
    a[0, 1] = a[0, 0] = 1e3
    # "cancel": the per-sample gradient cancels too, to below its instantiation's rounding (the
    # sample's other positions silent: float64 Grams); "grams": only the Grams cancel
    a[0, 1, 0] = 1e3 * (1 + 2 ** (-20 if kind == "cancel" else -6))
    g[0, 0], g[0, 1] = 1e2, -1e2
    if kind == "cancel":
        g[0, 2:] = 0
    return lin, [(a, g)]


def _conv_pairs():
    gen = gen_for(6)
    conv = nn.Conv2d(3, 8, 3, padding=1, groups=1)
    return conv, [(torch.randn(2, 3, 6, 6, generator=gen),
                   1e-3 * torch.randn(2, 8, 6, 6, generator=gen))]


def _grouped_conv_pairs():
    gen = gen_for(8)
    conv = nn.Conv2d(4, 6, 3, groups=2)
    return conv, [(torch.randn(2, 4, 5, 5, generator=gen),
                   torch.randn(2, 6, 3, 3, generator=gen))]


def _embedding_pairs():
    gen = gen_for(9)
    emb = nn.Embedding(5, 12)
    return emb, [(torch.randint(0, 5, (3, 16), generator=gen),
                  torch.randn(3, 16, 12, generator=gen))]


@pytest.mark.parametrize("case", [_linear_pairs, _conv_pairs, _grouped_conv_pairs,
                                  _embedding_pairs])
def test_honest_float32_certified_norms_dispatch_no_float64_matmul(case):
    module, pairs = case()
    rule = find_rule(module)
    with MatmulDtypes() as seen:
        bound = rule.certified_norm_sq(module, pairs, True)
    assert seen.seen, "no matmul seen: the Grams were not formed"
    assert all(dt != torch.float64 for _, dt in seen.seen), seen.seen
    wide = [(a if not a.is_floating_point() else a.double(), g.double()) for a, g in pairs]
    grads = rule.per_sample_grads(module, wide)
    ref = sum(t.flatten(1).square().sum(1) for t in grads.values())
    assert bool((bound >= ref).all())
    assert torch.allclose(bound.sqrt(), ref.sqrt(), rtol=1e-3, atol=0)


def test_sample_whose_grams_alone_cancel_takes_no_float64_matmul():
    """Gram entries that cancel (a loose fast bound) around a per-sample gradient that does not:
    the second try instantiates it in float32 (10 positions: fewer products than the Grams)."""
    module, pairs = _linear_pairs("grams")
    rule = find_rule(module)
    with MatmulDtypes() as seen:
        bound = rule.certified_norm_sq(module, pairs, True)
    assert all(dt != torch.float64 for _, dt in seen.seen), seen.seen
    a, g = pairs[0]
    ref = exact_sq(a, g)
    assert bool((bound >= ref).all())
    assert torch.allclose(bound[1:].sqrt(), ref[1:].sqrt(), rtol=1e-3, atol=0)


def test_crafted_float32_sample_alone_takes_float64_matmuls():
    module, pairs = _linear_pairs("cancel")
    rule = find_rule(module)
    with MatmulDtypes() as seen:
        bound = rule.certified_norm_sq(module, pairs, True)
    wide = [(name, dt) for name, dt in seen.seen if dt == torch.float64]
    assert wide  # the crafted sample's float64 Grams
    a, g = pairs[0]
    ref = exact_sq(a, g)
    assert bool((bound >= ref).all())
    assert torch.allclose(bound[1:].sqrt(), ref[1:].sqrt(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_repeated_token_that_cancels_is_bounded(dtype):
    """A token repeated at two positions with opposite gradients: the float32 Gram's bound is
    loose, the float64 Gram replaces it, and the bound covers the exact norm."""
    emb = nn.Embedding(5, 12)
    gen = gen_for(10)
    ids = torch.randint(0, 5, (3, 6), generator=gen)
    g = torch.randn(3, 6, 12, generator=gen)
    ids[0, 0] = ids[0, 1] = 2
    g[0, 1] = -g[0, 0] * (1 + 2 ** -7)
    g[0, 0] *= 1e4
    g[0, 1] *= 1e4
    g = g.to(dtype)
    rule = find_rule(emb)
    with MatmulDtypes() as seen:
        bound = rule.certified_norm_sq(emb, [(ids, g)], True)
    assert any(dt == torch.float64 for _, dt in seen.seen)  # the crafted sample's float64 Gram
    ref = rule.per_sample_grads(emb, [(ids, g.double())])["weight"].flatten(1).square().sum(1)
    assert bool((bound >= ref).all())
    assert torch.allclose(bound[1:].sqrt(), ref[1:].sqrt(), rtol=1e-3, atol=0)


def test_patch_like_inputs_with_correlated_gradients_stay_in_float32():
    """A layer whose one-pass float32 bound is loose for honest samples (nearly orthogonal inputs,
    correlated gradients) is bounded again with blocked float32 Grams, not float64 ones."""
    gen = gen_for(13)
    lin = nn.Linear(768, 256)
    a = torch.randn(2, 196, 768, generator=gen)
    g = torch.randn(1, 1, 256, generator=gen) + 0.05 * torch.randn(2, 196, 256, generator=gen)
    rule = find_rule(lin)
    with MatmulDtypes() as seen:
        bound = rule.certified_norm_sq(lin, [(a, g)], True)
    assert all(dt != torch.float64 for _, dt in seen.seen), seen.seen
    ref = exact_sq(a, g)
    assert bool((bound >= ref).all())
    assert torch.allclose(bound.sqrt(), ref.sqrt(), rtol=2e-3, atol=0)


def test_a_sample_with_a_zero_gradient_takes_no_second_try():
    """A zero output gradient (ν̃ = 0, a slack of underflow terms only) takes no float64 Grams."""
    lin, pairs = _linear_pairs()
    a, g = pairs[0]
    g = g.clone()
    g[1] = 0
    rule = find_rule(lin)
    with MatmulDtypes() as seen:
        bound = rule.certified_norm_sq(lin, [(a, g)], True)
    assert all(dt != torch.float64 for _, dt in seen.seen), seen.seen
    assert 0 <= bound[1] < 1e-30


def test_vit_qkv_on_noise_inputs_takes_no_second_try(monkeypatch):
    """ViT-Tiny's ``qkv`` (192 → 576, 197 positions, batch 16) on noise inputs: nearly orthogonal
    inputs and output gradients nearly equal at every position make the fast slack about
    1.3·10⁻³·ν, below twice the release's own rounding term (3.6·10⁻³·√ν·c_r·M): no second try,
    and the bound covers the exact norm."""
    from private_engine.layers import gram

    gen = gen_for(16)
    lin = nn.Linear(192, 576)
    a = torch.randn(16, 197, 192, generator=gen)
    g = 1e-3 * (torch.randn(1, 1, 576, generator=gen)
                + 0.1 * torch.randn(16, 197, 576, generator=gen))
    tries = []
    own = gram.second_try
    monkeypatch.setattr(gram, "second_try", lambda *args: tries.append(1) or own(*args))
    bound = find_rule(lin).certified_norm_sq(lin, [(a, g)], True)
    assert not tries
    assert bool((bound >= exact_sq(a, g)).all())


def test_patch_embedding_forms_per_sample_gradients_not_grams(monkeypatch):
    """A ViT-style patch embedding (16×16 patches of 3 channels: 768 inputs, 8 outputs, 16
    positions) whose per-sample gradients take fewer products than its Grams: the certified norm
    forms them in float32 (no Gram, no float64 matmul) and covers the exact norm within 10⁻³."""
    from private_engine.layers import gram

    gen = gen_for(17)
    conv = nn.Conv2d(3, 8, 16, stride=16)
    pairs = [(torch.randn(2, 3, 64, 64, generator=gen),
              1e-3 * torch.randn(2, 8, 4, 4, generator=gen))]
    grams = []
    own = gram._gram32
    monkeypatch.setattr(gram, "_gram32", lambda *args: grams.append(1) or own(*args))
    rule = find_rule(conv)
    with MatmulDtypes() as seen:
        bound = rule.certified_norm_sq(conv, pairs, True)
    assert not grams
    assert seen.seen and all(dt == torch.float32 for _, dt in seen.seen), seen.seen
    wide = [(a.double(), g.double()) for a, g in pairs]
    ref = sum(t.flatten(1).square().sum(1) for t in rule.per_sample_grads(conv, wide).values())
    assert bool((bound >= ref).all())
    assert torch.allclose(bound.sqrt(), ref.sqrt(), rtol=1e-3, atol=0)
