"""Mixed precision: bfloat16 autocast (CPU) in every mode, and float16 loss scaling with a
GradScaler (book-keeping modes) — the clipped results against references computed at the same
precision, and the loss-scaled path against the unscaled one (scaling by a power of two is
exact)."""
import copy
import logging

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import MODES, gen_for, pick_threshold, quadratic_loss, ref_abadi, target_like
from reference import assert_close_rel, reference_clipped_sum

pytestmark = pytest.mark.usefixtures("one_thread")

BK_MODES = [m for m in MODES if m.startswith("bk")]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]


def _vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                             num_classes=5)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2), nn.Flatten(), nn.Linear(8 * 15 * 15, 5))


def _autocast_reference(model, x, y, dtype):
    """Per-sample gradients of the autocast forward, one sample at a time, then abadi clipping
    (float64 sums)."""
    params = [p for p in model.parameters() if p.requires_grad]
    per = []
    for i in range(x.shape[0]):
        with torch.autocast(x.device.type, dtype=dtype):
            out = model(x[i:i + 1])
        per.append([g.double()
                    for g in torch.autograd.grad(F.cross_entropy(out.float(), y[i:i + 1]), params)])
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in per])
    R = pick_threshold(norms)
    C = ref_abadi(norms, R)
    return [sum(C[i] * per[i][k] for i in range(len(per))) for k in range(len(params))], norms, R


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build", [_vit, _cnn], ids=["vit", "cnn"])
def test_bfloat16_autocast_matches_the_per_sample_autocast_reference(build, mode, device):
    """bf16 matmuls inside the rules, certified norms in float64: within bf16 precision (≈ 2⁻⁸) of
    the sample-by-sample gradients of the same autocast forward; clipped sums are float32. On
    CUDA the batched and the one-sample convolutions run different cuDNN bf16 kernels (their
    per-sample gradients differ by about 1 %, seen on an H100), so norms get the sums' 2e-2."""
    model = build().to(device)
    gen = gen_for(1)
    x = torch.randn(6, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, 5, (6,), generator=gen).to(device)
    ref_sum, ref_norms, R = _autocast_reference(model, x, y, torch.bfloat16)
    engine = pe.PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = model(x)
    grads, _ = engine.clipped_grad_sum(F.cross_entropy(out.float(), y, reduction="none"))
    assert engine.last_norms.dtype == torch.float64 and all(g.dtype == torch.float32 for g in grads)
    norm_tol = 2e-2 if device == "cuda" else 1e-2
    assert_close_rel([engine.last_norms.cpu()], [ref_norms.cpu()], norm_tol, ["norms"])
    flat = lambda gs: [torch.cat([g.double().cpu().flatten() for g in gs])]  # noqa: E731
    assert_close_rel(flat(grads), flat(ref_sum), 2e-2, ["clipped sum"])


def _linear_case(B=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.LayerNorm(7), nn.Unflatten(1, (7, 1)),
                          nn.Linear(1, 3))
    gen = gen_for(2)
    x = torch.randn(B, 5, generator=gen)
    return model, x, target_like(model.double(), x.double(), gen).float()


def _engine(model, mode, R, scaler=None, B=6, dynamic=False):
    return pe.PrivacyEngine(model.float(), batch_size=B, sample_size=10 * B, max_grad_norm=R,
                            noise_multiplier=0.0, clipping_mode=mode, grad_scaler=scaler,
                            dynamic_loss_scale=dynamic)


@pytest.mark.parametrize("mode", BK_MODES)
def test_grad_scaler_path_equals_the_unscaled_one(mode):
    """Loss × 2¹² in the backward, norms and sums ÷ 2¹² in float32: the same clipped sum and norms
    as without scaling (powers of two scale exactly); with dynamic_loss_scale the scale follows
    GradScaler's growth schedule."""
    model, x, t = _linear_case()
    R = 0.5
    plain = _engine(copy.deepcopy(model), mode, R)
    m2 = plain.model
    expected, _ = plain.clipped_grad_sum(quadratic_loss(m2, x, t))
    expected_norms = plain.last_norms
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1)
    engine = _engine(model, mode, R, scaler, dynamic=True)
    grads, _ = engine.clipped_grad_sum(quadratic_loss(model, x, t))
    assert_close_rel(grads, expected, 1e-6)
    assert_close_rel([engine.last_norms], [expected_norms], 1e-6)
    assert scaler.get_scale() == 2.0 ** 13  # growth_interval=1: one good batch doubles the scale
    assert engine.loss_scaling.dropped_samples == 0


@pytest.mark.parametrize("mode", BK_MODES)
def test_grad_scaler_drops_only_the_overflowing_sample(mode):
    """Sample 0 overflows float32 (its loss ≈ 10⁴⁸; S = 2⁵⁰): it gets C_0 = 0 and its rows are
    zeroed, the other samples' clipped sum equals the float64 reference without it. By default the
    scale stays fixed (a scale that backed off would tell later steps that a private sample
    overflowed); with dynamic_loss_scale it backs off."""
    model, x, t = _linear_case()
    x = x.clone()
    x[0] *= 1e24
    t = t.clone()
    t[0] *= 1e24
    ref_model = copy.deepcopy(model).double()
    _, norms = reference_clipped_sum(ref_model, [x[1:].double(), t[1:].double()], quadratic_loss,
                                     1.0, ref_abadi)
    R = pick_threshold(norms)
    ref_sum, _ = reference_clipped_sum(ref_model, [x[1:].double(), t[1:].double()], quadratic_loss,
                                       R, ref_abadi)
    for dynamic in (False, True):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 50)
        engine = _engine(copy.deepcopy(model), mode, R, scaler, dynamic=dynamic)
        grads, n = engine.clipped_grad_sum(quadratic_loss(engine.model, x, t))
        scaling = engine.loss_scaling
        assert n == 6 and scaling.dropped_samples == 1 and scaling.overflow_batches == 1
        assert all(torch.isfinite(g).all() for g in grads)
        assert engine.last_norms[0] == 0 and (engine.last_norms[1:] > 0).all()
        assert_close_rel(grads, ref_sum, 1e-5)
        assert scaler.get_scale() == (2.0 ** 49 if dynamic else 2.0 ** 50)


@pytest.mark.parametrize("mode", BK_MODES)
def test_float16_overflow_in_one_sample_does_not_reach_the_others(mode):
    """float16 autocast: sample 0's activations overflow (inf loss, inf/NaN rows in its activations
    and output gradients). It is dropped and its rows zeroed before the clipped sum (0·inf would be
    NaN): the result is the clipped sum of the other samples computed without it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    gen = gen_for(4)
    x = torch.randn(6, 5, generator=gen)
    x[0] *= 1e6
    t = torch.randn(6, 3, generator=gen)

    def clipped(xs, ts):
        engine = pe.PrivacyEngine(copy.deepcopy(model), batch_size=6, sample_size=60,
                                  max_grad_norm=0.5, noise_multiplier=0.0, clipping_mode=mode,
                                  grad_scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 4))
        with torch.autocast("cpu", dtype=torch.float16):
            out = engine.model(xs)
        return engine, engine.clipped_grad_sum(quadratic_loss(lambda z: out.float(), None, ts))[0]

    engine, grads = clipped(x, t)
    assert engine.loss_scaling.dropped_samples == 1
    assert all(torch.isfinite(g).all() for g in grads)
    _, without = clipped(x[1:], t[1:])
    assert_close_rel(grads, without, 1e-3)


@pytest.mark.parametrize("scaler_args", [{"init_scale": 2.0 ** 8}, {}],
                         ids=["init_scale-2^8", "torch-defaults"])
def test_float16_autocast_with_grad_scaler_matches_the_per_sample_float16_reference(scaler_args):
    """A float16 autocast step with a GradScaler: within float16 precision of the sample-by-sample
    gradients of the same autocast forward, no honest sample dropped — with GradScaler's defaults
    too (torch's 2¹⁶ overflows float16 on per-sample losses: the engine starts such a scaler at
    2¹⁰)."""
    model = _vit()
    gen = gen_for(3)
    x = torch.randn(6, 3, 32, 32, generator=gen)
    y = torch.randint(0, 5, (6,), generator=gen)
    ref_sum, _, R = _autocast_reference(model, x, y, torch.float16)
    scaler = torch.amp.GradScaler("cpu", **scaler_args)
    engine = pe.PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode="bk_mixed", grad_scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    grads, _ = engine.clipped_grad_sum(F.cross_entropy(out.float(), y, reduction="none"))
    assert engine.loss_scaling.dropped_samples == 0
    flat = lambda gs: [torch.cat([g.double().flatten() for g in gs])]  # noqa: E731
    assert_close_rel(flat(grads), flat(ref_sum), 1e-2, ["clipped sum"])
    assert scaler.get_scale() == scaler_args.get("init_scale", 2.0 ** 10)


def test_grad_scaler_given_scale_is_kept_and_overflow_is_told_with_the_fix(caplog):
    """An init_scale the user chose is kept as given; when it makes half the batch or more
    overflow, a DEBUG record (whether samples overflowed depends on the data) names the fix (a
    lower init_scale), not grad_scaler= again."""
    model = _vit()
    gen = gen_for(3)
    x = torch.randn(6, 3, 32, 32, generator=gen)
    y = torch.randint(0, 5, (6,), generator=gen)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 17)
    engine = pe.PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0,
                              noise_multiplier=0.0, grad_scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    with caplog.at_level(logging.DEBUG, logger="private_engine.clipping.batch"):
        engine.clipped_grad_sum(F.cross_entropy(out.float(), y, reduction="none"))
    assert any("init_scale=2048" in r.getMessage() for r in caplog.records)
    assert engine.loss_scaling.dropped_samples >= 3 and scaler.get_scale() == 2.0 ** 17


def test_grad_scaler_needs_a_book_keeping_mode_and_a_scaler():
    model, _, _ = _linear_case()
    with pytest.raises(ValueError, match="book-keeping"):
        _engine(model, "mixed", 1.0, torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="GradScaler"):
        _engine(model, "bk", 1.0, object())
    # a disabled scaler is none
    disabled = _engine(model, "mixed", 1.0, torch.amp.GradScaler("cpu", enabled=False))
    assert not disabled.loss_scaling.enabled


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_private_steps_under_autocast(amp, device):
    """End to end: DP-Adam steps with virtual steps under autocast (float16 with a GradScaler)
    update every parameter, stay finite, account every logical batch and lower the training loss on
    a learnable task."""
    torch.manual_seed(0)
    model = _cnn().to(device)
    gen = gen_for(5)
    x = torch.randn(16, 3, 32, 32, generator=gen).to(device)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 8) if amp == "fp16" else None
    engine = pe.PrivacyEngine(model, batch_size=16, sample_size=160, max_grad_norm=1.0,
                              noise_multiplier=0.1, clipping_mode="bk_mixed", grad_scaler=scaler)
    opt = pe.optim.DPAdam(model.parameters(), lr=3e-3, privacy_engine=engine)
    before = [p.detach().clone() for p in model.parameters()]

    def losses():
        with torch.autocast(device, dtype=dtype):
            out = model(x)
        return F.cross_entropy(out.float(), y, reduction="none")

    first = float(losses().mean())
    for _ in range(8):
        with torch.autocast(device, dtype=dtype):
            out_a = model(x[:8])
        opt.virtual_step(loss=F.cross_entropy(out_a.float(), y[:8], reduction="none"))
        with torch.autocast(device, dtype=dtype):
            out_b = model(x[8:])
        opt.step(loss=F.cross_entropy(out_b.float(), y[8:], reduction="none"))
        opt.zero_grad()
    assert engine.steps_taken == 8
    assert all(torch.isfinite(p).all() and not torch.equal(p, b)
               for p, b in zip(model.parameters(), before))
    assert float(losses().mean()) < first


@pytest.mark.parametrize("frozen_weight", [False, True])
@pytest.mark.parametrize("shape", [(4, 16), (4, 5, 16), (4, 3, 5, 16)])
def test_autocast_records_the_operand_autograd_saved(shape, frozen_weight):
    """Under autocast a Linear's recorded activation is the bf16 operand of its matmul: the very
    tensor autograd saved (same storage, no second float32 copy kept alive) or, with nothing saved,
    one cast of the input."""
    from private_engine.capture.recorder import autocast_operand

    lin = nn.Linear(16, 8)
    lin.weight.requires_grad_(not frozen_weight)
    x = torch.randn(*shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
        a = autocast_operand(x, out)
    assert a.dtype == torch.bfloat16 and a.shape == x.shape and not a.requires_grad
    assert torch.equal(a, x.to(torch.bfloat16))
    node = out.grad_fn if len(shape) == 2 else out.grad_fn.next_functions[0][0]
    if not frozen_weight:
        assert a.untyped_storage().data_ptr() == node._saved_mat1.untyped_storage().data_ptr()
    # outside autocast, or when the layer ran in float32: the input itself
    assert autocast_operand(x, lin(x)).data_ptr() == x.data_ptr()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert autocast_operand(x, lin(x)).dtype == torch.float32


def test_engine_keeps_bfloat16_activations_under_autocast():
    """What book-keeping keeps for a ViT's layers under bf16 autocast is bf16 (half the bytes of
    float32)."""
    model = _vit()
    engine = pe.PrivacyEngine(model, batch_size=2, sample_size=20, max_grad_norm=1.0,
                              noise_multiplier=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 3, 32, 32))
    recorded = {layer.name: layer.calls[0].activation.dtype
                for layer in engine.clipper.recorder.layers
                if layer.calls and isinstance(layer.module, nn.Linear)}
    assert recorded and set(recorded.values()) == {torch.bfloat16}, recorded
    engine.clipper.recorder.reset()
