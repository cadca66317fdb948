"""The examples write only where they are told: by default under outputs/ in the checkout (ignored
by git), never into a tracked file or the current directory."""
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _defaults():
    probe = _load("linear_probe.py").parse_args([])
    audit = _load("privacy_audit.py").parse_args([])
    mae = _load("dp_mae_pretrain.py").parse_args([])
    return {"linear_probe plot": probe.plot, "linear_probe cache": probe.cache_dir,
            "privacy_audit plot": audit.plot, "dp_mae_pretrain checkpoints": mae.out_dir}


@pytest.mark.parametrize("what", ["linear_probe plot", "linear_probe cache",
                                  "privacy_audit plot", "dp_mae_pretrain checkpoints"])
def test_default_outputs_are_under_the_ignored_outputs_folder(what):
    path = Path(_defaults()[what])
    assert path.is_absolute() and ROOT / "outputs" in path.parents, path
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT,
                             capture_output=True)
    assert tracked.returncode != 0, f"{path} is a tracked file"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT)
    assert ignored.returncode == 0, f"{path} is not ignored by git"


def test_linear_probe_writes_only_into_its_output_dir(tmp_path, monkeypatch, capsys):
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code = _load("linear_probe.py").main(
        ["--output-dir", str(out), "--features", "raw", "--methods", "ls", "--epsilons", "1",
         "--seeds", "1", "--quiet"])
    assert code == 0
    assert os.listdir(cwd) == []
    assert (out / "linear_probe.png").stat().st_size > 0
    assert str(out / "linear_probe.png") in capsys.readouterr().out
