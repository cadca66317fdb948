"""The command line answers bad input in one line on stderr, exit status 2, naming what to
change; ``plan`` takes Hugging Face models whose config.json is on disk (no weights, no network)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from private_engine.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _refusal(capsys, argv):
    """The one stderr line of a refused command line (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


LENGTH = ["--sample-size", "50000", "--epochs", "1"]


@pytest.mark.parametrize("argv, expected", [
    (["noise", "--epsilon", "3", "--batch-size", "60000", "--sample-size", "50000",
      "--steps", "10"], "--batch-size 60000 is larger than --sample-size 50000"),
    (["epsilon", "--noise-multiplier", "1", "--batch-size", "60000", "--sample-size", "50000",
      "--steps", "10"], "at most 1"),
    (["noise", "--epsilon", "0.0001", "--batch-size", "256", *LENGTH],
     "raise --epsilon or --delta, or train for fewer --epochs/--steps"),
    (["noise", "--epsilon", "0", "--batch-size", "256", *LENGTH], "--epsilon must be a positive"),
    (["noise", "--epsilon", "3", "--batch-size", "0", *LENGTH], "--batch-size must be at least 1"),
    (["noise", "--epsilon", "3", "--batch-size", "1", "--sample-size", "50000",
      "--epochs", "0.00001"], "fewer than one: give more --epochs, or --steps"),
    (["noise", "--epsilon", "3", "--batch-size", "256", *LENGTH, "--delta", "2"],
     "--delta must be in (0, 1)"),
    (["epsilon", "--noise-multiplier", "-1", "--batch-size", "256", *LENGTH],
     "--noise-multiplier must be a positive"),
    (["plan", "--model", "no_such_model_anywhere"], "unknown model 'no_such_model_anywhere'"),
    (["plan", "--model", "resnet18", "--input-size", "3,x"], "expected comma-separated integers"),
    (["plan", "--model", "resnet18", "--input-size", "3,0,32"], "positive integer"),
    (["plan", "--model", "resnet18", "--input-size", "32"],
     "give --input-size as the shape of one sample"),
])
def test_bad_input_is_one_line_naming_the_fix(capsys, argv, expected):
    line = _refusal(capsys, argv)
    assert line.startswith("private-engine "), line
    assert expected in line, line


def test_the_installed_command_exits_2_without_a_traceback():
    cmd = [sys.executable, "-m", "private_engine.cli", "noise", "--epsilon", "3",
           "--batch-size", "60000", "--sample-size", "50000", "--steps", "10"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "sampling rate q = B/n must be at most 1" in out.stderr


def _gpt2_folder(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json"]   # no weights
    return str(tmp_path)


def test_plan_builds_a_hugging_face_model_from_its_config_alone(capsys, tmp_path):
    folder = _gpt2_folder(tmp_path)
    assert main(["plan", "--model", folder, "--input-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "at 8 tokens" in out
    # c_attn: T = 8 tokens, D = 16, p = 3·16 = 48: 2T² = 128 < pD = 768 -> ghost
    row = next(line for line in out.splitlines() if line.startswith("h.0.attn.c_attn "))
    assert "Conv1D" in row and row.rstrip().endswith("ghost"), row
    assert next(line for line in out.splitlines() if line.startswith("wte "))


def test_plan_refuses_token_lengths_the_config_cannot_take(capsys, tmp_path):
    folder = _gpt2_folder(tmp_path)
    line = _refusal(capsys, ["plan", "--model", folder, "--input-size", "64"])
    assert "at most 32 tokens" in line
    line = _refusal(capsys, ["plan", "--model", folder, "--input-size", "3,8,8"])
    assert "one sequence length T" in line


def test_plan_names_a_folder_without_a_config(capsys, tmp_path):
    line = _refusal(capsys, ["plan", "--model", str(tmp_path)])
    assert "without a config.json" in line
