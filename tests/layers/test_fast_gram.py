"""Ghost norms from float32 Grams with a per-sample rounding bound
(:mod:`private_engine.layers.gram`): the bound is never below the exact (float64) squared norm, on
random and crafted samples (cancellation, huge, tiny and subnormal, mixed scales) in float32,
bfloat16 and float16; and it is within 10⁻³ of the norm for honest samples."""
import pytest
import torch

from engine_checks import gen_for
from private_engine.layers import gram
from private_engine.layers.gram import certified_ghost_sq, fast_ghost_bound
from private_engine.layers.rounding import pair_norms

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def exact_sq(a: torch.Tensor, g: torch.Tensor, bias: bool) -> torch.Tensor:
    """``‖g_iᵀ ã_i‖²_F`` per sample in float64 from the operands as they are (the per-sample
    gradient formed, not its ghost norm)."""
    A, G = a.double(), g.double()
    if bias:
        A = torch.cat([A, torch.ones_like(A[..., :1])], 2)
    return torch.einsum("ntp,ntd->npd", G, A).square().sum((1, 2))


def bound_of(a, g, bias):
    na, ng = pair_norms(a, g, bias)
    out = certified_ghost_sq(a, g, bias, na, ng)
    assert out is not None and out.dtype == torch.float64
    return out


def honest(n, T, D, p, dtype, seed):
    gen = gen_for(seed)
    # activations with a common component (as after a LayerNorm with a bias), gradients small
    a = torch.randn(n, T, D, generator=gen) + 0.5 * torch.randn(1, 1, D, generator=gen)
    g = 1e-3 * torch.randn(n, T, p, generator=gen)
    return a.to(dtype), g.to(dtype)


def crafted(kind: str, dtype):
    """Four samples of 3 positions, width 8 (input) and 5 (output); sample 0 is crafted."""
    gen = gen_for(7)
    a = torch.randn(4, 3, 8, generator=gen)
    g = torch.randn(4, 3, 5, generator=gen)
    if kind == "cancel":  # equal large inputs at two positions, opposite gradients
        a[0, 1] = a[0, 0] = 1e3
        a[0, 1, 0] = 1e3 * (1 + 2 ** -6)
        g[0, 0], g[0, 1] = 1e2, -1e2
    elif kind == "huge":  # float32 norms overflow: the bound is inf (the engine drops it)
        a[0] = 1e30
    elif kind == "large":  # Gram entries near float32's overflow
        a[0] = 3e18
        g[0] = 1e-20
    elif kind == "tiny":
        a[0] = 1e-30 * a[0]
        g[0] = 1e-20 * g[0]
    elif kind == "subnormal":
        a[0] = 1e-41 * torch.sign(a[0])
        g[0] = 1e-40 * torch.sign(g[0])
    elif kind == "mixed":  # positions at very different scales in one sample
        a[0, 0] *= 1e12
        a[0, 2] *= 1e-12
        g[0, 1] *= 1e-15
    if dtype == torch.float16:
        lim = torch.finfo(torch.float16).max
        a, g = a.clamp(-lim, lim), g.clamp(-lim, lim)
    return a.to(dtype), g.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["random", "cancel", "huge", "large", "tiny", "subnormal",
                                  "mixed"])
def test_bound_is_at_least_the_exact_norm(dtype, bias, kind):
    if kind == "random":
        a, g = honest(4, 9, 12, 7, dtype, 3)
    else:
        a, g = crafted(kind, dtype)
    got, ref = bound_of(a, g, bias), exact_sq(a, g, bias)
    ok = torch.isinf(got) | (got >= ref)
    assert bool(ok.all()), (got - ref).tolist()
    assert not bool(torch.isnan(got).any())
    if kind == "huge" and dtype != torch.float16:
        assert torch.isinf(got[0])  # not finite: dropped by the engine, never under-clipped
    # the honest samples of a crafted batch keep a tight bound
    assert torch.allclose(got[1:].sqrt(), ref[1:].sqrt(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_crafted_cancellation_takes_the_float64_grams(dtype):
    """The fast bound of a sample that cancels is loose; the float64 Grams replace it."""
    a, g = crafted("cancel", dtype)
    na, ng = pair_norms(a, g, True)
    fast, slack, nu = fast_ghost_bound(a, g, True, na, ng, False, 2.0 ** -149)
    assert slack[0] > 1e-3 * nu[0]
    got, ref = bound_of(a, g, True), exact_sq(a, g, True)
    assert got[0] < fast[0] and got[0] >= ref[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 197, 192, 576), (3, 50, 256, 64), (4, 17, 64, 256)])
def test_honest_bound_within_1e_3_of_the_norm(dtype, bias, shape):
    n, T, D, p = shape
    a, g = honest(n, T, D, p, dtype, 11)
    got, ref = bound_of(a, g, bias), exact_sq(a, g, bias)
    rel = got.sqrt() / ref.sqrt() - 1
    assert bool((rel >= 0).all()) and bool((rel <= 1e-3).all()), rel.tolist()


def patch_like(T: int, D: int, p: int, dtype, seed: int = 12):
    """Image-patch-like inputs of noise (a nearly diagonal Gram) with correlated output gradients
    (a dense one), two samples: the one-pass float32 bound is loose (``≈ T·γ_D·ν``)."""
    gen = gen_for(seed)
    a = torch.randn(2, T, D, generator=gen).to(dtype)
    g = (torch.randn(1, 1, p, generator=gen)
         + 0.05 * torch.randn(2, T, p, generator=gen)).to(dtype)
    na, ng = pair_norms(a, g, True)
    _, slack, nu = fast_ghost_bound(a, g, True, na, ng, False, 2.0 ** -149)
    assert bool((slack > 2e-3 * nu).all())
    return a, g


def _spy(monkeypatch, name):
    """Record the calls of ``gram.<name>``."""
    calls = []
    own = getattr(gram, name)
    monkeypatch.setattr(gram, name, lambda *args, **kw: calls.append(1) or own(*args, **kw))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nearly_diagonal_gram_against_a_dense_one_takes_the_per_sample_gradients(
        monkeypatch, dtype):
    """At a ViT patch embedding's shape (196 positions, 768 inputs) the per-sample gradients take
    fewer products than the Grams: the second try forms them in float32 and bounds the norm within
    10⁻³, with no float64 Gram and no blocked Gram."""
    a, g = patch_like(196, 768, 192, dtype)
    blocked, exact = _spy(monkeypatch, "_gram_chunked"), _spy(monkeypatch, "exact_ghost_bound")
    got, ref = bound_of(a, g, True), exact_sq(a, g, True)
    rel = got.sqrt() / ref.sqrt() - 1
    assert bool((rel >= 0).all()) and bool((rel <= 1e-3).all()), rel.tolist()
    assert not blocked and not exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nearly_diagonal_gram_with_few_positions_takes_the_blocked_grams(monkeypatch, dtype):
    """With 50 positions the Grams take fewer products than the per-sample gradients: where the
    second try is not by float64 Grams (CUDA's choice, set here), the blocked float32 Grams
    (float64 block sums, no float64 matmul) bring the bound within 10⁻³."""
    monkeypatch.setattr(gram, "FLOAT64_SECOND_TRY", ())
    a, g = patch_like(50, 768, 256, dtype)
    blocked, exact = _spy(monkeypatch, "_gram_chunked"), _spy(monkeypatch, "exact_ghost_bound")
    got, ref = bound_of(a, g, True), exact_sq(a, g, True)
    rel = got.sqrt() / ref.sqrt() - 1
    assert bool((rel >= 0).all()) and bool((rel <= 1e-3).all()), rel.tolist()
    assert blocked and not exact


@pytest.mark.parametrize("per_run", [None, 1], ids=["one_run", "sample_by_sample"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_try_on_the_cpu_takes_float64_grams(monkeypatch, dtype, per_run):
    """On the CPU the second try of the same loose samples forms float64 Grams at once (no
    blocked float32 Gram), in runs of samples within ``FLOAT64_ROWS_BYTES`` (one here, when
    ``per_run``): every bound is above the float64 per-sample reference and within 10⁻³ of it."""
    if per_run is not None:
        monkeypatch.setattr(gram, "FLOAT64_ROWS_BYTES", 8 * 50 * (768 + 256 + 100))
    a, g = patch_like(50, 768, 256, dtype)
    blocked, exact = _spy(monkeypatch, "_gram_chunked"), _spy(monkeypatch, "exact_ghost_bound")
    got, ref = bound_of(a, g, True), exact_sq(a, g, True)
    rel = got.sqrt() / ref.sqrt() - 1
    assert bool((rel >= 0).all()) and bool((rel <= 1e-3).all()), rel.tolist()
    assert not blocked and len(exact) == (2 if per_run else 1)


@pytest.mark.parametrize("crafted", ["huge", "tiny", "subnormal", "cancel"])
def test_float64_second_try_bounds_crafted_samples(crafted):
    """The CPU's float64 second try (:func:`gram.float64_rows`) of a crafted sample beside an
    honest one: every bound is at least the sample's float64 per-sample norm² — and for inputs of
    1e30, whose row norms overflow float32, infinite (the engine drops the sample), never NaN."""
    a, g = patch_like(50, 768, 256, torch.float32)
    if crafted == "huge":
        a[1] = 1e30
    elif crafted == "tiny":
        a[1] *= 1e-20
    elif crafted == "subnormal":
        g[1] = 1e-41
    else:
        a1, g1 = cancelling_gradient(50, 768)
        a[1], g[1] = a1[0], g1[0, :, :256]
    na, ng = pair_norms(a, g, True)
    got = gram.float64_rows(a, g, True, na, ng)
    ref = exact_sq(a, g, True)
    assert got.dtype == torch.float64 and not bool(got.isnan().any())
    assert bool(torch.isfinite(got[0])) and bool((got >= ref).all()), (got - ref).tolist()
    assert bool(torch.isfinite(got[1])) == (crafted != "huge")


def cancelling_gradient(T: int, width: int):
    """One sample whose per-sample gradient cancels in float32: inputs ``x·(1 + 2⁻¹²)`` and
    ``x·(1 + 2⁻¹¹)`` at alternate positions, output gradients ``u·(1 + 2⁻¹²)`` and ``−u`` (``x``,
    ``u`` of entries ±2¹³, ±2⁶): each pair of products is ``±2¹⁹·(1 + 2⁻¹¹ + 2⁻²⁴)`` against
    ``∓2¹⁹·(1 + 2⁻¹¹)``, which float32 rounds to cancel, so ``fl(gᵀa) ≈ 0`` while every entry of
    the exact gradient is ±1 (norm ``width``)."""
    gen = gen_for(13)
    x = 2.0 ** 13 * torch.randint(0, 2, (width,), generator=gen).mul(2).sub(1).float()
    u = 2.0 ** 6 * torch.randint(0, 2, (width,), generator=gen).mul(2).sub(1).float()
    even = torch.arange(T) % 2 == 0
    a = torch.where(even[:, None], x * (1 + 2.0 ** -12), x * (1 + 2.0 ** -11))
    g = torch.where(even[:, None], u * (1 + 2.0 ** -12), -u)
    return a.unsqueeze(0), g.unsqueeze(0)


@pytest.mark.parametrize("bias", [False, True])
def test_instantiated_bound_covers_a_gradient_that_cancels_in_float32(bias):
    """The per-sample gradient's float32 norm is far below the exact one; the instantiated bound
    (its ``γ_{T+1}·M`` term) covers it, is loose, and the float64 Grams follow."""
    a, g = cancelling_gradient(64, 32)
    na, ng = pair_norms(a, g, bias)
    ref = exact_sq(a, g, bias)
    assert ref[0] >= 1000.0
    bound, slack, nu = gram.instantiated_ghost_bound(a, g, bias, na, ng)
    assert nu[0] < 0.1 * ref[0]  # the float32 gradient alone would under-clip
    assert bound[0] >= ref[0]
    assert not bool(gram.tight(bound, slack, nu).all())
    assert bool((bound_of(a, g, bias) >= ref).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_instantiated_bound_covers_16_bit_sums_that_lose_a_position(dtype, bias):
    """16-bit operands (widened to float32: exact products) whose float32 sums over positions
    lose a small position between two large ones of opposite signs."""
    gen = gen_for(14)
    T, D, p = 48, 32, 24
    a = torch.randn(2, T, D, generator=gen).sign().mul(64.0)
    scale = torch.tensor([2.0 ** 12, 2.0 ** -4, -(2.0 ** 12)]).repeat(T // 3)
    g = torch.randn(2, 1, p, generator=gen).sign() * scale.view(1, T, 1)
    a, g = a.to(dtype), g.to(dtype)
    na, ng = pair_norms(a, g, bias)
    ref = exact_sq(a, g, bias)
    bound, _, _ = gram.instantiated_ghost_bound(a, g, bias, na, ng)
    assert bool((bound >= ref).all())
    assert bool((bound_of(a, g, bias) >= ref).all())


def qkv_like():
    """ViT-Tiny's ``qkv`` at 224² on noise inputs, two samples: 197 positions of 192 nearly
    orthogonal inputs, 576 output gradients nearly equal at every position; the release
    coefficient of a batch of 16 (``B·T`` rows)."""
    from private_engine.layers.rounding import release_coefficient

    gen = gen_for(15)
    a = torch.randn(2, 197, 192, generator=gen)
    g = 1e-3 * (torch.randn(1, 1, 576, generator=gen) + 0.1 * torch.randn(2, 197, 576,
                                                                          generator=gen))
    return a, g, release_coefficient(torch.float32, torch.device("cpu"), 16 * 197)


def test_slack_within_the_release_term_takes_no_second_try(monkeypatch):
    """A fast bound above ``LOOSE·ν̃`` whose slack is below ``2·c_r·M·√ν̃`` is kept: the released
    bound ``(√(ν̃ + slack) + c_r M)²`` is then within ``2·c_r·M`` of the norm, which a second try
    would leave at ``c_r·M``. Without the release coefficient, the same samples take one."""
    from private_engine.layers.rounding import certified_ghost, mass_of

    a, g, c_rel = qkv_like()
    na, ng = pair_norms(a, g, True)
    fast, slack, nu = fast_ghost_bound(a, g, True, na, ng, False, 2.0 ** -149)
    assert bool((slack > gram.LOOSE * nu).all())
    tries = _spy(monkeypatch, "second_try")
    got = certified_ghost_sq(a, g, True, na, ng, c_rel)
    assert not tries and torch.equal(got, fast)
    ref = exact_sq(a, g, True)
    assert bool((got >= ref).all())
    mass = mass_of(na, ng, a.shape[2])
    released = certified_ghost(got, mass, 0.0, c_rel).sqrt()
    assert bool((released <= ref.sqrt() + 2 * c_rel * mass).all())
    certified_ghost_sq(a, g, True, na, ng)
    assert len(tries) == 1


@pytest.mark.parametrize("kind", ["cancel", "large", "tiny", "subnormal", "mixed"])
def test_a_large_release_coefficient_keeps_only_upper_bounds(kind):
    """Crafted samples with a release coefficient so large (10⁻²) that nearly every fast bound is
    kept: what is kept is still at least the exact norm."""
    a, g = crafted(kind, torch.float32)
    na, ng = pair_norms(a, g, True)
    got, ref = certified_ghost_sq(a, g, True, na, ng, 1e-2), exact_sq(a, g, True)
    assert bool((got >= ref).all()), (got - ref).tolist()


def test_blocked_gram_gamma_is_the_block_s_plus_the_float64_sum():
    from private_engine.layers.gram import gram_gamma
    from private_engine.layers.rounding import gamma, unit_roundoff

    u32, u64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
    assert gram_gamma(768, False) == gamma(768, u32)
    assert gram_gamma(768, False, 64) == gamma(64, u32) + 2 * gamma(13, u64)
    assert gram_gamma(769, False, 64) == gamma(64, u32) + 2 * gamma(14, u64)


def _blocked_calls(monkeypatch, t):
    """``(the float64 blocked Gram of t, the batch sizes of the float32 Grams it formed)``."""
    batches = []
    own = gram._gram32
    monkeypatch.setattr(gram, "_gram32",
                        lambda x, rows=None: batches.append(x.shape[0]) or own(x, rows))
    return gram._gram_chunked(t, gram.CHUNK), batches


@pytest.mark.parametrize("samples", [1, 3])
def test_a_few_loose_samples_take_all_their_blocks_at_once(monkeypatch, samples):
    """At ViT-B/16's shapes (197 positions, 3,072 columns: 48 blocks) the second try of a few
    samples forms all their blocks' Grams in one matmul, and their float64 sum is the exact
    float64 sum of the float32 block Grams."""
    t = torch.randn(samples, 197, 3072, generator=torch.Generator().manual_seed(1))
    got, batches = _blocked_calls(monkeypatch, t)
    assert batches == [samples * 48]
    blocks = t.reshape(samples, 197, 48, 64).permute(0, 2, 1, 3)
    each = torch.matmul(blocks, blocks.transpose(2, 3)).double()
    assert torch.allclose(got, each.sum(1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("one_by_one", [True, False], ids=["added", "reduced"])
def test_second_try_grams_are_formed_a_few_blocks_at_a_time(monkeypatch, one_by_one):
    """The blocked Grams of a wide operand (21 blocks of 64 columns, the last one padded) are
    formed as many blocks per matmul as ``GRAM_ENTRIES_AT_ONCE`` allows (8 here), not all at once,
    and their float64 sum — added block by block (the CPU's way) or by one reduction per group
    (other devices') — stays within ``gram_gamma(w, chunk)·‖t_t‖‖t_s‖`` of the exact Gram."""
    t = torch.randn(3, 5, 64 * 20 + 7, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(gram, "GRAM_ENTRIES_AT_ONCE", 8 * 3 * 5 * 5 + 7)
    monkeypatch.setattr(gram, "ADDED_ONE_BY_ONE", ("cpu",) if one_by_one else ())
    got, batches = _blocked_calls(monkeypatch, t)
    assert batches == [3 * 8, 3 * 8, 3 * 5]
    t64 = t.double()
    exact = torch.bmm(t64, t64.transpose(1, 2))
    norms = t64.norm(dim=2)
    gamma = gram.gram_gamma(t.shape[2], False, gram.CHUNK)
    allowed = gamma * norms.unsqueeze(2) * norms.unsqueeze(1)
    assert bool(((got - exact).abs() <= allowed).all())
