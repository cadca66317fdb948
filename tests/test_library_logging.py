"""The library reports through ``logging`` (the "private_engine" logger and its children), never by
printing: the engine's parameters, dropped samples, checkpoints, the recipes' epoch lines."""
import logging

import torch
from torch import nn

import private_engine as pe
from private_engine.pretrain import SyntheticConfig, SyntheticImages, build_mae, pretrain_synthetic


def _messages(caplog, name):
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_the_package_logger_is_silent_until_configured():
    handlers = logging.getLogger("private_engine").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_engine_dropped_samples_and_checkpoints_are_logged(caplog, tmp_path):
    model = nn.Linear(3, 1)
    with caplog.at_level(logging.INFO, logger="private_engine"):
        engine = pe.PrivacyEngine(model, batch_size=4, sample_size=100, max_grad_norm=1.0,
                                  noise_multiplier=1.5)
        optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        loss = model(torch.randn(3, 3)).squeeze(1) + torch.tensor([0.0, float("nan"), 0.0])
        optimizer.step(loss=loss)
        pe.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=optimizer, engine=engine)
    (built,) = _messages(caplog, "private_engine.engine")
    assert "σ=1.5" in built and "q=0.04" in built and "mode=bk_mixed" in built
    assert _messages(caplog, "private_engine.clipping.batch") == [
        "1 of 3 samples of this batch dropped (clip factor 0): non-finite loss or gradient norm"]
    (saved,) = _messages(caplog, "private_engine.checkpoint")
    assert "c.pt after 1 steps" in saved


def test_recipe_epoch_lines_are_log_records_not_prints(caplog, capsys):
    torch.manual_seed(0)
    model = build_mae(img_size=8, patch_size=2, depth=1, embed_dim=16, num_heads=2,
                      decoder_dim=16, decoder_depth=1, decoder_heads=2)
    with caplog.at_level(logging.INFO, logger="private_engine"):
        pretrain_synthetic(model, SyntheticImages(32, size=8, seed=0),
                           SyntheticConfig(epochs=1, batch_size=16), progress=False,
                           evaluate=lambda: 0.5)
    lines = _messages(caplog, "private_engine.pretrain.recipe")
    assert lines[0] == "synthetic pre-training: test loss before 0.5000"
    assert lines[1].startswith("synthetic epoch 1: train loss ")
    assert capsys.readouterr().out == ""
