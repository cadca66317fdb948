"""examples/finetune_timm_vit.py --tensorboard DIR: a short run writes a TensorBoard log with ε
and the loss of every step, read back with TensorBoard's own reader."""
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FINAL = re.compile(r"^ε=([0-9.]+) ")


def test_example_writes_epsilon_and_loss_of_every_step(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = importlib.util.spec_from_file_location("finetune_timm_vit",
                                                  ROOT / "examples" / "finetune_timm_vit.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    logdir = tmp_path / "tb"
    example.main(["--img-size", "16", "--patch-size", "4", "--depth", "1", "--subset", "48",
                  "--epochs", "1", "--batch-size", "16", "--physical-batch-size", "8",
                  "--epsilon", "4", "--tensorboard", str(logdir)])
    final_eps = float(FINAL.match(capsys.readouterr().out.strip().splitlines()[-1]).group(1))

    events = EventAccumulator(str(logdir))
    events.Reload()
    eps = [(e.step, e.value) for e in events.Scalars("privacy/epsilon")]
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    steps = 48 // 16  # Poisson batches: len(loader) = n / B per epoch
    assert [s for s, _ in eps] == list(range(1, steps + 1))
    values = [v for _, v in eps]
    assert all(0 < a < b for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(final_eps, abs=1e-3)
    # a (Poisson) batch may be empty (probability (2/3)⁴⁸ ≈ 4·10⁻⁹ here): its step has no loss
    assert [s for s, _ in loss] == list(range(1, steps + 1))
    assert all(v > 0 for _, v in loss)
    fractions = [e.value for e in events.Scalars("train/clip_fraction")]
    assert all(0 <= f <= 1 for f in fractions)
