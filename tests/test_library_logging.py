"""The library reports through ``logging`` (the "private_engine" logger and its children), never by
printing: the engine's parameters, dropped samples (at DEBUG: a membership signal), checkpoints,
the recipes' epoch lines."""
import logging
import warnings

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
    with caplog.at_level(logging.DEBUG, logger="private_engine"):
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


def _told(caplog, losses) -> list:
    """The warnings and the log records at INFO and above of a step per per-sample loss vector
    (losses: callables of the model) on a fresh engine, as messages."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, \
            caplog.at_level(logging.INFO, logger="private_engine"):
        warnings.simplefilter("always")
        engine = pe.PrivacyEngine(model, batch_size=4, sample_size=100, max_grad_norm=1.0,
                                  noise_multiplier=1.5)
        optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        for loss in losses:
            optimizer.step(loss=loss(model))
    return [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]


def test_a_non_finite_sample_in_or_out_of_the_batch_leaves_the_same_warnings_and_records(caplog):
    """Whether a sample was dropped tells whether it was in the batch: a sample with a NaN loss
    in or out of the batch (with honest ones, alone or an empty batch) gives the same warnings and
    INFO records."""
    x = torch.randn(3, 3)

    def honest(model):
        return model(x).squeeze(1)

    nan = torch.full((1, 3), float("nan"))

    def crafted(model):
        return model(torch.cat([x, nan])).squeeze(1)

    def alone(model):
        return model(nan).squeeze(1)

    def empty(model):
        return model(x[:0]).squeeze(1)

    without = _told(caplog, [honest, empty])
    assert _told(caplog, [crafted, alone]) == without


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
