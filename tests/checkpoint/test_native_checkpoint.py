"""Kill a training process (SIGKILL) and resume it from its last checkpoint in a new one: the final
parameters are bit-identical to an uninterrupted run's and ε is equal. The run is
tests/checkpoint/resume_worker.py (seeded data, initialisation, Poisson loader and noise
generator; gradient accumulation; a checkpoint after every physical batch)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import private_engine as pe

WORKER = Path(__file__).with_name("resume_worker.py")
REPO = Path(__file__).resolve().parents[2]
STEPS = 10

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGKILL")


def _run(ckpt, out, *args, expect_kill=False):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run([sys.executable, str(WORKER), "--ckpt", str(ckpt), "--out", str(out),
                           "--steps", str(STEPS), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split() for line in proc.stdout.splitlines() if line.startswith("PHYSICAL")]


def _log(lines):
    """{physical batch: (steps done, accumulating, epoch, batch in epoch)}."""
    return {int(w[1]): (int(w[3]), bool(int(w[5])), int(w[7]), int(w[9])) for w in lines}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    log = _log(_run(folder / "ckpt.pt", folder / "out.pt"))
    return log, torch.load(folder / "out.pt", weights_only=True)


def _assert_same_result(out, reference):
    result = torch.load(out, weights_only=True)
    assert result["steps"] == reference["steps"] == STEPS
    assert result["physical"] == reference["physical"]
    assert len(result["params"]) == len(reference["params"])
    for p, q in zip(result["params"], reference["params"]):
        assert torch.equal(p, q)
    assert result["epsilon"] == reference["epsilon"] > 0


def _kill_points(log):
    """Physical batches to be killed after: in an accumulation in the middle of an epoch (the
    second epoch), right after a step in the middle of an epoch, and at the end of an epoch."""
    mid_accumulation = next(k for k, (s, acc, e, b) in sorted(log.items())
                            if acc and e == 1 and b in (1, 2))
    after_step = next(k for k, (s, acc, e, b) in sorted(log.items())
                      if not acc and e == 1 and b == 1)
    epoch_end = next(k for k, (s, acc, e, b) in sorted(log.items())
                     if not acc and e == 1 and log.get(k + 1, (0, 0, 2))[2] == 2)
    return sorted({mid_accumulation, after_step, epoch_end})


def test_killed_and_resumed_runs_end_bit_identical(tmp_path, uninterrupted):
    """Killed three times (mid-accumulation, right after a step, at an epoch's end), resumed each
    time in a new process: the same parameters, bit for bit, and the same ε."""
    log, reference = uninterrupted
    points = _kill_points(log)
    assert len(points) == 3
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    resume = []
    for k in points:
        lines = _run(ckpt, out, "--kill-at", k, *resume, expect_kill=True)
        assert int(lines[-1][1]) == k  # killed right after that checkpoint
        state = torch.load(ckpt, weights_only=True)
        assert state["extra"]["physical"] == k
        accumulating = state["engine"]["accumulation"][0] is not None
        assert accumulating == log[k][1]
        assert state["engine"]["noise_generator"] is not None
        resume = ["--resume"]
    assert not out.exists()
    _run(ckpt, out, "--resume")
    _assert_same_result(out, reference)


def test_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path,
                                                                          uninterrupted):
    """SIGKILL halfway through writing the checkpoint of physical batch k: the file is still the
    whole checkpoint of batch k − 1 (only a temporary file is half-written), and resuming from it
    ends as the uninterrupted run."""
    log, reference = uninterrupted
    k = next(k for k, (s, acc, e, b) in sorted(log.items()) if acc and e == 1 and k > 1)
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    lines = _run(ckpt, out, "--kill-in-save", k, expect_kill=True)
    assert int(lines[-1][1]) == k - 1
    state = torch.load(ckpt, weights_only=True)
    assert state["extra"]["physical"] == k - 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert leftovers and all(n.startswith(".ckpt.pt.") and n.endswith(".tmp") for n in leftovers)
    _run(ckpt, out, "--resume")
    _assert_same_result(out, reference)


def test_public_api():
    assert pe.save_checkpoint.__module__ == "private_engine.checkpoint"
    assert {"save_checkpoint", "load_checkpoint"} <= set(pe.__all__)
