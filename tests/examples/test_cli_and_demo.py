"""The command line (plan, epsilon, noise) and the demo example run and print what they promise."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from opacus.accountants import RDPAccountant

from private_engine.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_plan_prints_the_rule_for_every_layer(capsys):
    assert main(["plan", "--model", "resnet18", "--input-size", "3,32,32"]) == 0
    out = capsys.readouterr().out
    assert "BatchNorm replaced by GroupNorm" in out
    # conv1: 7x7 stride 2 on 32x32 -> T = 16·16 = 256, D = 3·49 = 147, p = 64: 2T² = 131,072 > pD =
    # 9,408
    row = next(line for line in out.splitlines() if line.startswith("conv1 "))
    assert re.search(r"\b256\b.*\b147\b.*\b64\b.*131,072.*9,408\s+instantiate$", row), row
    # fc: T = 1, D = 512, p = 1000: 2 < 512,000 -> ghost
    row = next(line for line in out.splitlines() if line.startswith("fc "))
    assert row.rstrip().endswith("ghost"), row
    assert "per-sample memory (elements)" in out


def test_plan_names_parameters_without_a_layer_rule(capsys):
    assert main(["plan", "--model", "vit_tiny_patch16_224", "--input-size", "3,224,224"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "parameter-entry tracer" in line)
    assert "cls_token" in line and "pos_embed" in line, out


def test_epsilon_matches_opacus_and_noise_inverts_it(capsys):
    assert main(["epsilon", "--noise-multiplier", "1.1", "--batch-size", "256",
                 "--sample-size", "60000", "--epochs", "2", "--delta", "1e-5"]) == 0
    eps = float(re.search(r"ε = ([0-9.]+)", capsys.readouterr().out).group(1))
    acc = RDPAccountant()
    acc.history = [(1.1, 256 / 60000, int(2 / (256 / 60000)))]
    assert eps == pytest.approx(acc.get_epsilon(1e-5), abs=1e-4)

    assert main(["noise", "--epsilon", f"{eps}", "--batch-size", "256", "--sample-size", "60000",
                 "--epochs", "2", "--delta", "1e-5"]) == 0
    sigma = float(re.search(r"σ = ([0-9.]+)", capsys.readouterr().out).group(1))
    assert sigma == pytest.approx(1.1, rel=0.02)


def test_demo_example_trains_and_reports_privacy():
    cmd = [sys.executable, str(ROOT / "examples" / "finetune_timm_vit.py"), "--epochs", "1",
           "--depth", "1", "--batch-size", "128", "--physical-batch-size", "48"]
    # this checkout's private_engine, not an installed one
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "vit_tiny_patch16_224 at 8×8" in out.stdout and "n=1438, test 359" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"ε=([0-9.]+) δ=([0-9.e+-]+) σ=([0-9.]+) accuracy=([0-9.]+) seconds=([0-9.]+)",
                     last)
    assert m, last
    eps, delta, sigma, acc = (float(m.group(1)), float(m.group(2)), float(m.group(3)),
                              float(m.group(4)))
    assert 0 < eps <= 8.0 + 1e-6 and delta == pytest.approx(1 / (2 * 1438), rel=1e-2) and sigma > 0
    assert 0.0 <= acc <= 1.0
