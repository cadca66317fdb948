"""Kill a training process (SIGKILL) and resume it from its last checkpoint in a new one
(tests/checkpoint/resume_worker.py).

* A reproducible run (seeded data, initialisation, Poisson loader and noise generator; gradient
  accumulation; a checkpoint after every logical batch) ends with the parameters of an
  uninterrupted run, bit for bit; every checkpoint attempted in the middle of a logical batch is
  refused.
* The run an attacker watches (secret noise, fresh Poisson batches): killed two updates after its
  checkpoint and resumed, its first update after the checkpoint differs from the killed run's by
  fresh noise of the mechanism's scale, and ε counts the updates the killed run released after
  the checkpoint.
"""
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import resume_worker as worker  # tests/checkpoint is on sys.path (pytest's rootdir import)
import torch

import private_engine as pe
from private_engine.accounting import epsilon_for

WORKER = Path(__file__).with_name("resume_worker.py")
REPO = Path(__file__).resolve().parents[2]
UPDATES = 10

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGKILL")


def _run(ckpt, out, *args, updates=UPDATES, expect_kill=False):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run([sys.executable, str(WORKER), "--ckpt", str(ckpt), "--out", str(out),
                           "--updates", str(updates), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split() for line in proc.stdout.splitlines()
            if line.startswith(("UPDATE", "RESUMED"))]


def _log(lines):
    """{update: (steps counted, epoch, batch in epoch, refused mid-batch saves)}."""
    return {int(w[1]): (int(w[3]), int(w[5]), int(w[7]), int(w[9]))
            for w in lines if w[0] == "UPDATE"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    log = _log(_run(folder / "ckpt.pt", folder / "out.pt"))
    return log, torch.load(folder / "out.pt", weights_only=True)


def _assert_same_parameters(out, reference):
    result = torch.load(out, weights_only=True)
    assert result["updates"] == reference["updates"] == UPDATES
    assert len(result["params"]) == len(reference["params"])
    for p, q in zip(result["params"], reference["params"]):
        assert torch.equal(p, q)
    return result


def test_killed_and_resumed_runs_end_bit_identical(tmp_path, uninterrupted):
    """The reproducible run killed twice (mid-epoch, at an epoch's end), right after a checkpoint,
    and resumed each time in a new process: the same parameters, bit for bit, and the same ε (no
    step was released after a checkpoint). Every save attempted mid-batch was refused; the file
    holds the state of the generator the user gave and no accumulation."""
    log, reference = uninterrupted
    assert log[UPDATES][3] > 0  # mid-batch checkpoints were attempted, and refused
    mid_epoch = next(u for u, (s, e, b, r) in sorted(log.items()) if e == 1 and b == 1)
    epoch_end = next(u for u, (s, e, b, r) in sorted(log.items())
                     if e == 1 and log.get(u + 1, (0, 2))[1] == 2)
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    resume = []
    for u in (mid_epoch, epoch_end):
        lines = _run(ckpt, out, "--kill-at", u, *resume, expect_kill=True)
        assert int(lines[-1][1]) == u  # killed right after that update's checkpoint
        state = torch.load(ckpt, weights_only=True)
        assert state["extra"]["updates"] == u
        assert state["engine"]["noise_generator"] is not None  # a given generator: reproducible
        assert "accumulation" not in state["engine"]
        resume = ["--resume"]
    assert (tmp_path / "ckpt.pt.ledger").exists() and not (tmp_path / "ckpt.pt.mid").exists()
    assert not out.exists()
    _run(ckpt, out, "--resume")
    result = _assert_same_parameters(out, reference)
    assert result["steps"] == reference["steps"] == UPDATES
    assert result["epsilon"] == reference["epsilon"] > 0


def test_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path,
                                                                          uninterrupted):
    """SIGKILL halfway through writing the checkpoint of update u: the file is still the whole
    checkpoint of update u − 1 (only a temporary file is half-written). Update u was released
    before the kill, so the resumed run counts it on top of its own: the same parameters as the
    uninterrupted run (the reproducible run draws update u again), one step more in ε."""
    log, reference = uninterrupted
    u = next(u for u, (s, e, b, r) in sorted(log.items()) if e == 1 and u > 1)
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    lines = _run(ckpt, out, "--kill-in-save", u, expect_kill=True)
    assert int(lines[-1][1]) == u - 1
    state = torch.load(ckpt, weights_only=True)
    assert state["extra"]["updates"] == u - 1
    leftovers = [p.name for p in tmp_path.iterdir()
                 if p.name not in ("ckpt.pt", "ckpt.pt.ledger")]
    assert leftovers and all(n.startswith(".ckpt.pt.") and n.endswith(".tmp") for n in leftovers)
    lines = _run(ckpt, out, "--resume")
    assert lines[0][0] == "RESUMED" and int(lines[0][4]) == u  # the ledger counts update u
    result = _assert_same_parameters(out, reference)
    assert result["steps"] == reference["steps"] + 1
    assert result["epsilon"] > reference["epsilon"]


def test_secret_run_killed_after_its_checkpoint_draws_fresh_noise_and_counts_every_release(
        tmp_path):
    """The attacker's view of a deployment (default noise generator, default Poisson loader): the
    run checkpoints every 3 updates and is killed after update 5, having released updates 4 and
    5 after its checkpoint; a new process resumes from the checkpoint of update 3.

    The observer subtracts the two runs' iterates at update 4, both one SGD step from the same
    checkpointed parameters: with the killed run's noise replayed the difference would be the
    tiny data term alone; it must carry two independent noise draws, std √2·lr·σR/B per
    coordinate. The resumed run counts the killed run's 5 steps before its own, and its file
    holds no generator state."""
    ckpt, out, seen = tmp_path / "ckpt.pt", tmp_path / "out.pt", tmp_path / "seen"
    seen.mkdir()
    common = ["--secret", "--every", 3, "--iterates", seen]
    _run(ckpt, out, *common, "--kill-at", 5, "--tag", "killed", updates=6, expect_kill=True)
    state = torch.load(ckpt, weights_only=True)
    lines = _run(ckpt, out, *common, "--resume", "--tag", "resumed", updates=6)
    assert lines[0][0] == "RESUMED" and int(lines[0][2]) == 3

    killed = torch.load(seen / "killed_4.pt", weights_only=True)
    resumed = torch.load(seen / "resumed_4.pt", weights_only=True)
    diff = killed - resumed
    scale = math.sqrt(2) * worker.SECRET_LR * worker.SIGMA * worker.R / worker.BATCH
    ratio = float(diff.square().mean().sqrt()) / scale  # ~ (χ²_d/d)^½, d = 512: sd ≈ 0.03
    assert 0.8 < ratio < 1.25, ratio

    assert int(lines[0][4]) == 5  # updates 1..5 were released
    assert state["extra"] == {"epoch": state["extra"]["epoch"], "batch": state["extra"]["batch"],
                              "updates": 3}
    assert state["engine"]["noise_generator"] is None
    assert not (tmp_path / "ckpt.pt.mid").exists()
    result = torch.load(out, weights_only=True)
    assert result["steps"] == 5 + 3
    delta = 1 / (2 * worker.SAMPLES)
    q = worker.BATCH / worker.SAMPLES
    assert result["epsilon"] >= epsilon_for(worker.SIGMA, q, 5, delta) > 0
    assert result["epsilon"] == pytest.approx(epsilon_for(worker.SIGMA, q, 8, delta))


def test_public_api():
    assert pe.save_checkpoint.__module__ == "private_engine.checkpoint"
    assert {"save_checkpoint", "load_checkpoint"} <= set(pe.__all__)
