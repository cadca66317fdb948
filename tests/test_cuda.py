"""The engine on CUDA: float32 clipped sums vs the float64 CPU reference, and training steps."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import CLIPS, ENGINE_CLIP, MODES, REF_CLIP, gen_for, pick_threshold, ref_abadi
from reference import assert_close_rel, reference_clipped_sum

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RTOL_F32 = 1e-4


@pytest.fixture(autouse=True)
def no_tf32():
    """Full float32 convolutions and matmuls: TF32 (cuDNN's default on Ampere+) alone is ~1e-3
    off."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding="same", padding_mode="reflect")
        # zero padding: handed to the kernel
        self.dw = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.gn = nn.GroupNorm(4, 8)
        self.proj = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.emb = nn.Embedding(11, 16, padding_idx=0)
        self.head = nn.Linear(16, 5)

    def forward(self, x, ids):
        h = F.relu(self.conv(x), inplace=True)
        h = self.gn(self.dw(h))
        h = self.ln(self.proj(h.permute(0, 2, 3, 1)))  # Linear on (B, H, W, C)
        h = h.mean((1, 2)) + self.emb(ids).mean(1)
        return self.head(torch.tanh(h))


def _loss(model, x, ids, y):
    return F.cross_entropy(model(x, ids), y, reduction="none")


def _data(B=6, seed=0, device="cpu"):
    gen = gen_for(seed)
    x = torch.randn(B, 3, 9, 9, generator=gen)
    ids = torch.randint(0, 11, (B, 5), generator=gen)
    y = torch.randint(0, 5, (B,), generator=gen)
    return [t.to(device) for t in (x, ids, y)]


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_clipped_sum_matches_float64_cpu_reference(mode, clip):
    torch.manual_seed(0)
    cpu_model = Net()
    inputs = _data()
    _, norms = reference_clipped_sum(cpu_model, inputs, _loss, 1.0, ref_abadi)
    R = pick_threshold(norms)
    ref_sum, ref_norms = reference_clipped_sum(cpu_model, inputs, _loss, R, REF_CLIP[clip])

    model = copy.deepcopy(cpu_model).cuda()
    engine = pe.PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode,
                              clipping_fn=ENGINE_CLIP[clip])
    cuda_inputs = [t.cuda() for t in inputs]
    grads, n = engine.clipped_grad_sum(_loss(model, *cuda_inputs))
    assert n == 6 and all(g.is_cuda and g.dtype == torch.float32 for g in grads)
    assert_close_rel([g.cpu() for g in grads], ref_sum, RTOL_F32)
    assert_close_rel([engine.last_norms.cpu()], [ref_norms], RTOL_F32)

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(loss=_loss(model, *cuda_inputs))
    assert_close_rel([(p.detach() - b).cpu() for p, b in zip(model.parameters(), before)],
                     [-r / 6 for r in ref_sum], RTOL_F32)


@pytest.mark.parametrize("mode", ("mixed", "bk", "bk_mixed", "bk_mixopt"))
def test_cuda_timm_vit_clipped_sum_matches_float64_cpu_reference(mode):
    """Every trainable parameter of a (small) timm ViT, cls_token and pos_embed included, on
    CUDA."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    cpu_model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                  embed_dim=48, num_heads=3, num_classes=5)
    gen = gen_for(1)
    inputs = [torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 5, (4,), generator=gen)]

    def vit_loss(model, x, y):
        return F.cross_entropy(model(x), y, reduction="none")

    _, norms = reference_clipped_sum(cpu_model, inputs, vit_loss, 1.0, ref_abadi)
    R = pick_threshold(norms)
    ref_sum, ref_norms = reference_clipped_sum(cpu_model, inputs, vit_loss, R, ref_abadi)
    model = copy.deepcopy(cpu_model).cuda()
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    grads, n = engine.clipped_grad_sum(vit_loss(model, *[t.cuda() for t in inputs]))
    assert n == 4 and len(grads) == len(ref_sum)
    assert_close_rel([g.cpu() for g in grads], ref_sum, RTOL_F32)
    assert_close_rel([engine.last_norms.cpu()], [ref_norms], RTOL_F32)


def test_cuda_training_steps_with_noise_and_accumulation():
    torch.manual_seed(0)
    model = Net().cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=800, max_grad_norm=1.0,
                              noise_multiplier=1.0, noise_generator=gen)
    opt = pe.optim.DPAdamW(model.parameters(), lr=1e-3, privacy_engine=engine)
    for step in range(3):
        x, ids, y = _data(8, seed=step, device="cuda")
        before = [p.detach().clone() for p in model.parameters()]
        opt.virtual_step(loss=_loss(model, x[:3], ids[:3], y[:3]))
        opt.step(loss=_loss(model, x[3:], ids[3:], y[3:]))
        opt.zero_grad()
        assert all(p.is_cuda and torch.isfinite(p).all() for p in model.parameters())
        assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert engine.steps_taken == 3 and engine.get_epsilon() > 0


def test_cuda_noise_std():
    torch.manual_seed(0)
    model = nn.Linear(100, 100).cuda()
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=400, max_grad_norm=0.5,
                              noise_multiplier=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    x = torch.randn(4, 100, device="cuda")
    opt.step(loss=(model(x) * 0).sum(1))
    noise = torch.cat([p.grad.flatten() for p in model.parameters()]).double().cpu()
    assert abs(noise.std().item() / (2.0 * 0.5 / 4) - 1) < 0.04
    assert abs(noise.mean().item()) < 5 * 0.25 / noise.numel() ** 0.5


def test_cuda_ghost_gram_on_padded_rows():
    """bf16 Grams with T = 197 (ViT at 224²) are computed on rows zero-padded to 200 (aligned for
    the tensor-core kernels): the padding is exact; the products of bf16 values are exact in the
    float32 accumulator, so the float64 inner product is within float32 accumulation error of the
    float64 value."""
    from private_engine.layers.base import aligned_positions, gram_inner

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(3, 197, 64, device="cuda", generator=gen).bfloat16()
    g = torch.randn(3, 197, 32, device="cuda", generator=gen).bfloat16()
    padded = aligned_positions(a)
    assert (padded.shape == (3, 200, 64) and torch.equal(padded[:, :197], a)
            and not padded[:, 197:].any())
    as_float = a.float()
    assert aligned_positions(as_float) is as_float  # float32: no padding
    ad, gd = a.double(), g.double()
    ref = ((ad @ ad.mT) * (gd @ gd.mT)).sum((1, 2))
    got = gram_inner(a, g)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=0)
    torch.testing.assert_close(gram_inner(a.float(), g.float()).double(), ref, rtol=1e-5, atol=0)
