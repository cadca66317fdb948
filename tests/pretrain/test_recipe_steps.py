"""The DP-MAES recipe on tiny settings: step 1 (non-private, synthetic) lowers the masked loss,
step 2 (DP-AdamW) spends at most the target ε with δ = 1/(2n) and σ calibrated, checkpoints and
resumes; the evaluation helpers."""
import math

import pytest
import torch
from torch.utils.data import TensorDataset

from private_engine.pretrain import (
    DPMAEConfig,
    SyntheticConfig,
    SyntheticImages,
    build_mae,
    dp_mae_train,
    encoder_features,
    format_comparison,
    pretrain_synthetic,
    probe_encoder,
    reconstruction_loss,
)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Optimal order")]


def tiny(seed=0):
    torch.manual_seed(seed)
    return build_mae(img_size=8, patch_size=2, depth=1, embed_dim=16, num_heads=2,
                     decoder_dim=16, decoder_depth=1, decoder_heads=2)


def private_data(n=96, seed=0):
    """Stand-in private images: blurred random blobs with a label (class = brightest quadrant)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.avg_pool2d(torch.randn(n, 3, 12, 12, generator=g), 5, 1)
    q = x.mean(1).unfold(1, 4, 4).unfold(2, 4, 4).mean((-1, -2)).flatten(1)
    return TensorDataset(x, q.argmax(1))


def test_synthetic_pretraining_lowers_the_loss():
    model = tiny()
    syn = SyntheticImages(256, size=8, seed=0)
    before = reconstruction_loss(model, syn)
    hist = pretrain_synthetic(model, syn, SyntheticConfig(epochs=3, batch_size=32, lr=3e-3),
                              progress=False)
    assert len(hist) == 3 and hist[-1] < hist[0]
    assert reconstruction_loss(model, syn) < before


def test_reconstruction_loss_uses_fixed_masks():
    model = tiny()
    data = private_data()
    assert reconstruction_loss(model, data, seed=1) == reconstruction_loss(model, data, seed=1)
    assert reconstruction_loss(model, data, seed=1) != reconstruction_loss(model, data, seed=2)


def test_dp_step_spends_the_budget_and_resumes(tmp_path):
    data = private_data()
    cfg = DPMAEConfig(epochs=2, batch_size=32, physical_batch_size=16, lr=1e-3)
    ckpt = str(tmp_path / "dp.pt")
    model = tiny()
    res = dp_mae_train(model, data, cfg, checkpoint=ckpt, progress=False,
                       loader_generator=torch.Generator().manual_seed(0))
    steps = 2 * (len(data) // 32)
    assert res.steps == steps and len(res.losses) == steps
    assert res.delta == pytest.approx(1 / (2 * len(data)))
    assert 0.5 * cfg.epsilon < res.epsilon <= cfg.epsilon * (1 + 1e-6)
    assert res.noise_multiplier > 0 and all(math.isfinite(v) for v in res.losses)
    assert all(p.grad is None for p in model.parameters())
    # resume from the last epoch's checkpoint: nothing left to train, same accounting
    again = tiny()
    res2 = dp_mae_train(again, data, cfg, checkpoint=ckpt, resume=True, progress=False)
    assert res2.steps == steps and res2.epsilon == pytest.approx(res.epsilon)
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)


def test_probe_row_and_table():
    model = tiny()
    train, test = private_data(120, seed=1), private_data(60, seed=2)
    feats = encoder_features(model, train.tensors[0])
    assert feats.shape == (120, 16)
    row = probe_encoder("random", model, train, test, methods=("ls",), epsilons=(8.0, math.inf),
                        seeds=2, blank=torch.zeros(3, 8, 8))
    assert 0 <= row.logreg <= 1 and set(row.dp["ls"]) == {8.0, math.inf}
    table = format_comparison([row])
    assert "DP-LS ε=8" in table and "DP-LS ε=∞" in table and "| random |" in table
