"""The private optimizer: gradient accumulation, the Gaussian noise, the divisor,
DP-SGD/Adam/AdamW."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import (
    MODES,
    RTOL,
    gen_for,
    make_engine,
    pick_threshold,
    quadratic_loss,
    ref_abadi,
    target_like,
)
from reference import assert_close_rel, reference_clipped_sum

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(15, 4)).double()


def _batch(model, B, seed=0):
    gen = gen_for(seed)
    x = torch.randn(B, 2, 5, generator=gen, dtype=torch.float64)
    return x, target_like(model, x, gen)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


# -- accumulation ----------------------------------------------------------------------------------
CHUNKINGS = [[4, 3], [3, 1, 2, 1], [1, 1, 1, 1, 1, 1, 1], [7]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "+".join(map(str, c)))
def test_accumulation_equals_one_big_batch(chunks, mode):
    """k virtual_step calls + one step on k+1 chunks == one step on the concatenated batch (noise
    0)."""
    B = sum(chunks)
    model = _model()
    x, t = _batch(model, B)
    _, norms = reference_clipped_sum(model, [x, t], quadratic_loss, 1.0, ref_abadi)
    R = pick_threshold(norms)
    ref_sum, _ = reference_clipped_sum(model, [x, t], quadratic_loss, R, ref_abadi)

    results = []
    for split in (chunks, [B]):
        m = copy.deepcopy(model)
        engine = make_engine(m, B, mode=mode, R=R)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        engine.attach(opt)
        before = _params(m)
        start = 0
        for k, n in enumerate(split):
            loss = quadratic_loss(m, x[start:start + n], t[start:start + n])
            start += n
            if k + 1 < len(split):
                opt.virtual_step(loss=loss)
                assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before)), \
                    "virtual_step moved θ"
                assert engine.steps_taken == 0
            else:
                opt.step(loss=loss)
        assert engine.steps_taken == 1
        results.append([p.detach() - b for p, b in zip(m.parameters(), before)])
    assert_close_rel(results[0], results[1], 1e-12)
    assert_close_rel(results[0], [-r / B for r in ref_sum], RTOL)


def test_accumulation_with_noise_draws_noise_once():
    """Same seeded noise_generator: chunks and one batch give the same noisy update (one draw)."""
    B, sigma, R = 6, 1.3, 0.7
    model = _model()
    x, t = _batch(model, B)
    updates, gens = [], []
    for split in ([2, 1, 3], [6]):
        m = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(1234)
        engine = make_engine(m, B, R=R, noise_multiplier=sigma, noise_generator=gen)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        engine.attach(opt)
        before = _params(m)
        start = 0
        for k, n in enumerate(split):
            loss = quadratic_loss(m, x[start:start + n], t[start:start + n])
            start += n
            (opt.virtual_step if k + 1 < len(split) else opt.step)(loss=loss)
        updates.append([p.detach() - b for p, b in zip(m.parameters(), before)])
        gens.append(gen.get_state())
    assert_close_rel(updates[0], updates[1], 1e-12)
    assert torch.equal(gens[0], gens[1]), "the chunked run drew a different amount of noise"


def test_noise_redrawn_each_logical_batch_and_state_reset():
    """Two logical batches: the second starts from empty sums, and draws fresh noise."""
    B = 4
    model = _model()
    x, t = _batch(model, B)
    engine = make_engine(model, B, R=1.0, noise_multiplier=1.0,
                         noise_generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: θ fixed, .grad holds ĝ
    engine.attach(opt)
    opt.virtual_step(loss=quadratic_loss(model, x, t))
    opt.step(loss=quadratic_loss(model, x, t))
    g1 = [p.grad.clone() for p in model.parameters()]
    opt.step(loss=quadratic_loss(model, x, t))
    g2 = [p.grad.clone() for p in model.parameters()]
    # signal of step 1 is twice that of step 2 (two chunks of the same batch); noise differs
    clean, _ = engine.clipped_grad_sum(quadratic_loss(model, x, t))
    n1 = torch.cat([(a - 2 * c / B).flatten() for a, c in zip(g1, clean)])
    n2 = torch.cat([(a - c / B).flatten() for a, c in zip(g2, clean)])
    assert not torch.allclose(n1, n2)
    assert engine.steps_taken == 2


def test_divisor_is_the_expected_batch_size():
    """ĝ = Σ C_i g_i / batch_size (declared), whatever the number of samples seen (Poisson
    batches)."""
    model = _model()
    x, t = _batch(model, 5)
    ref_sum, _ = reference_clipped_sum(model, [x, t], quadratic_loss, 0.5, ref_abadi)
    engine = make_engine(model, 8, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = _params(model)
    opt.step(loss=quadratic_loss(model, x, t))
    assert_close_rel([p.detach() - b for p, b in zip(model.parameters(), before)],
                     [-r / 8 for r in ref_sum], RTOL)


def test_empty_batch_is_a_noise_only_step():
    model = _model()
    engine = make_engine(model, 4, R=1.0, noise_multiplier=1.0,
                         noise_generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = _params(model)
    opt.step(loss=torch.zeros(0, dtype=torch.float64))
    assert engine.steps_taken == 1
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- the noise -------------------------------------------------------------------------------------
def _zero_grad_setup(sigma, R, B, dtype=torch.float64, gen=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 100)).to(dtype)
    engine = make_engine(model, B, R=R, noise_multiplier=sigma, noise_generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    x = torch.randn(B, 100, dtype=dtype)
    loss = (model(x) * 0).sum(1)  # requires grad, every per-sample gradient is 0
    return model, engine, opt, loss


def _check_standard_normal(z: torch.Tensor, tol_sd=0.04):
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n), z.mean()
    assert abs(z.std().item() - 1) < tol_sd, z.std()
    inside = (z.abs() < 1).double().mean().item()
    assert abs(inside - 0.6827) < 5 * math.sqrt(0.6827 * 0.3173 / n), inside
    stats = pytest.importorskip("scipy.stats")
    assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-4


@pytest.mark.parametrize("sigma,R,B", [(1.0, 1.0, 1), (0.7, 2.5, 8), (3.0, 0.1, 32)])
def test_noise_std_with_zero_gradients(sigma, R, B):
    """.grad after step is N(0, σ²R²)/B per coordinate (10,100 coordinates)."""
    model, engine, opt, loss = _zero_grad_setup(sigma, R, B)
    before = _params(model)
    opt.step(loss=loss)
    std = sigma * R / B
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    _check_standard_normal(noise / std)
    # the update is −lr·ĝ
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    torch.testing.assert_close(delta, -noise, rtol=1e-12, atol=1e-15)


def test_noise_std_float32_and_seeded_generator():
    gen = torch.Generator().manual_seed(7)
    model, engine, opt, loss = _zero_grad_setup(1.5, 0.4, 4, dtype=torch.float32, gen=gen)
    opt.step(loss=loss)
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert noise.dtype == torch.float32
    _check_standard_normal(noise / (1.5 * 0.4 / 4))
    # reproducible with the same seed
    gen2 = torch.Generator().manual_seed(7)
    model2, _, opt2, loss2 = _zero_grad_setup(1.5, 0.4, 4, dtype=torch.float32, gen=gen2)
    opt2.step(loss=loss2)
    assert torch.equal(noise, torch.cat([p.grad.flatten() for p in model2.parameters()]))


def test_noise_added_to_the_clipped_sum():
    """With real gradients: ĝ − (clean clipped sum)/B is N(0, σ²R²)/B, whatever the signal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(60, 80), nn.Tanh(), nn.Linear(80, 40)).double()
    B, sigma, R = 6, 0.9, 0.3
    x = torch.randn(B, 60, dtype=torch.float64)
    t = target_like(model, x, gen_for(0))
    ref_sum, _ = reference_clipped_sum(model, [x, t], quadratic_loss, R, ref_abadi)
    engine = make_engine(model, B, R=R, noise_multiplier=sigma)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    opt.step(loss=quadratic_loss(model, x, t))
    noise = torch.cat([(p.grad - r / B).flatten() for p, r in zip(model.parameters(), ref_sum)])
    _check_standard_normal(noise / (sigma * R / B))


def test_noise_std_does_not_grow_with_accumulation():
    B, sigma, R = 4, 2.0, 1.0
    model, engine, opt, _ = _zero_grad_setup(sigma, R, B)
    x = torch.randn(B, 100, dtype=torch.float64)
    for _ in range(3):
        opt.virtual_step(loss=(model(x) * 0).sum(1))
    opt.step(loss=(model(x) * 0).sum(1))
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    _check_standard_normal(noise / (sigma * R / B))


# -- DP optimizers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kwargs", [
    ("DPSGD", dict(lr=0.5)),
    ("DPSGD", dict(lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("DPAdam", dict(lr=0.01)),
    ("DPAdam", dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    ("DPAdamW", dict(lr=0.01, weight_decay=0.1)),
])
def test_dp_optimizers_match_torch_on_the_private_gradient(name, kwargs):
    """DPX(params, ..., privacy_engine=engine) == torch.optim.X fed (reference clipped sum)/B, 3
    steps."""
    cls = getattr(pe.optim, name)
    base = {"DPSGD": torch.optim.SGD, "DPAdam": torch.optim.Adam,
            "DPAdamW": torch.optim.AdamW}[name]
    assert issubclass(cls, base)
    B, R = 5, 0.5
    model = _model()
    twin = copy.deepcopy(model)
    engine = make_engine(model, B, R=R)
    opt = cls(model.parameters(), privacy_engine=engine, **kwargs)
    twin_opt = base(twin.parameters(), **kwargs)
    assert hasattr(opt, "virtual_step")
    for step in range(3):
        x, t = _batch(model, B, seed=step)
        ref_sum, _ = reference_clipped_sum(twin, [x, t], quadratic_loss, R, ref_abadi)
        if step == 1:  # a logical batch in two chunks
            opt.virtual_step(loss=quadratic_loss(model, x[:2], t[:2]))
            opt.step(loss=quadratic_loss(model, x[2:], t[2:]))
        else:
            opt.step(loss=quadratic_loss(model, x, t))
        opt.zero_grad()
        for p, r in zip(twin.parameters(), ref_sum):
            p.grad = r / B
        twin_opt.step()
        assert_close_rel(list(model.parameters()), list(twin.parameters()), 1e-10)
    assert engine.steps_taken == 3


def test_dp_optimizer_with_noise_trains_float32():
    """An end-to-end sanity run: DP-Adam with noise on a float32 model lowers a separable loss
    (batches of Poisson sizes, expected 64 of 640)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(inplace=True), nn.Linear(16, 2))
    engine = pe.PrivacyEngine(model, batch_size=64, sample_size=640, max_grad_norm=1.0,
                              noise_multiplier=0.5)
    opt = pe.optim.DPAdam(model.parameters(), lr=0.02, privacy_engine=engine)
    x = torch.randn(640, 10)
    y = (x[:, 0] > 0).long()
    first = F.cross_entropy(model(x), y).item()
    for size in torch.distributions.Binomial(640, torch.tensor(0.1)).sample((30,)).long():
        xb = torch.randn(int(size), 10)
        opt.step(loss=F.cross_entropy(model(xb), (xb[:, 0] > 0).long(), reduction="none"))
        opt.zero_grad()
    assert F.cross_entropy(model(x), y).item() < 0.7 * first
    assert engine.steps_taken == 30 and 0 < engine.get_epsilon() < math.inf


# -- book-keeping: one backward, no autograd weight gradient ---------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_book_keeping_runs_one_backward_and_forms_no_weight_gradient(mode, monkeypatch):
    """Book-keeping modes: a single autograd call per physical batch, during which autograd never
    computes a parameter gradient (hooks on every parameter stay silent); the two-pass modes run two
    activation-only backwards (the clipped sums come from the recorded layers in both) when the
    norm pass holds no layer's operands to its end (held ones are released from them)."""
    from private_engine.clipping import clipper, two_pass

    monkeypatch.setattr(clipper, "HELD_GRADIENTS", 0)
    monkeypatch.setattr(two_pass, "HELD_LOWEST", 0)
    model = _model()
    x, t = _batch(model, 5)
    engine = make_engine(model, 5, mode=mode, R=0.5)
    # the first step of an input signature also runs the separability probe: count the next one
    engine.clipped_grad_sum(quadratic_loss(model, x, t))
    fired = []
    handles = [p.register_hook(lambda g, n=n: fired.append(n)) for n, p in model.named_parameters()]
    calls = []
    real_grad = torch.autograd.grad

    def counting_grad(*args, **kwargs):
        calls.append(kwargs.get("retain_graph"))
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    grads, _ = engine.clipped_grad_sum(quadratic_loss(model, x, t))
    for h in handles:
        h.remove()
    if mode.startswith("bk"):
        assert calls == [False], calls  # one backward, graph freed as it goes
        assert fired == [], f"autograd formed weight gradients for {fired}"
    else:
        assert len(calls) == 2 and calls[0] is True
        assert fired == [], f"autograd formed weight gradients for {fired}"
    assert all(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("chunk", [7, 1 << 24])
def test_add_gaussian_noise_chunks(monkeypatch, chunk):
    """Noise drawn in shared chunks: every coordinate N(0, std²), independent across tensors (no
    chunk reused), each tensor keeps its dtype, tensors larger than a chunk included."""
    from private_engine.optim import noise as pe_noise

    monkeypatch.setattr(pe_noise, "NOISE_CHUNK", chunk)
    gen = torch.Generator().manual_seed(3)
    shapes = [(3,), (4, 5), (2000,), (1,), (0,), (30, 40)]
    tensors = [torch.zeros(s, dtype=torch.float64 if i % 2 else torch.float32)
               for i, s in enumerate(shapes)]
    pe_noise.add_gaussian_noise(tensors, 2.5, gen)
    assert [t.dtype for t in tensors] == [torch.float64 if i % 2 else torch.float32
                                          for i in range(len(shapes))]
    flat = torch.cat([t.double().flatten() for t in tensors])
    _check_standard_normal(flat / 2.5)
    # no two tensors got the same stretch of noise
    firsts = {round(float(t.flatten()[0]), 6) for t in tensors if t.numel()}
    assert len(firsts) == sum(t.numel() > 0 for t in tensors)
    # adds to what is there
    ones = [torch.ones(10)]
    pe_noise.add_gaussian_noise(ones, 0.0, gen)
    assert torch.equal(ones[0], torch.ones(10))
