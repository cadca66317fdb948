"""examples/dp_mae_pretrain.py end to end with tiny settings (embedded digits, no download): both
steps, the checkpoints, a resumed run, the probe table and plot, and the final line."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FINAL = re.compile(r"^ε=([0-9.]+) δ=([0-9.e+-]+) σ=([0-9.]+) loss=([0-9.]+) "
                   r"loss_synthetic=([0-9.]+) loss_random=([0-9.]+) seconds=([0-9.]+)$")
TINY = ["--img-size", "8", "--patch-size", "2", "--depth", "1", "--embed-dim", "16",
        "--num-heads", "2", "--decoder-dim", "16", "--decoder-depth", "1", "--decoder-heads", "2",
        "--synthetic-images", "96", "--synthetic-epochs", "1", "--synthetic-batch-size", "32",
        "--epochs", "1", "--batch-size", "64", "--physical-batch-size", "32", "--subset", "128",
        "--quiet", "--threads", "1"]

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order")


def load_example():
    spec = importlib.util.spec_from_file_location("dp_mae_pretrain",
                                                  ROOT / "examples" / "dp_mae_pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_runs_both_steps_and_probes(tmp_path, capsys):
    out_dir, plot, table = tmp_path / "ckpt", tmp_path / "probe.png", tmp_path / "table.md"
    res = load_example().main(TINY + ["--out-dir", str(out_dir), "--probe", "--plot", str(plot),
                                      "--table", str(table), "--probe-methods", "ls",
                                      "--probe-epsilons", "8"])
    out = capsys.readouterr().out
    m = FINAL.match(out.strip().splitlines()[-1])
    assert m, out.strip().splitlines()[-1]
    eps, delta = float(m.group(1)), float(m.group(2))
    assert 0 < eps <= 8.0 + 1e-6 and delta == pytest.approx(1 / (2 * 128), rel=1e-2)
    assert float(m.group(4)) == pytest.approx(res["loss"], abs=1e-4)
    for name in ("synthetic.pt", "dp_mae.pt", "dp_mae_final.pt"):
        assert (out_dir / name).exists(), name
    assert plot.stat().st_size > 0
    text = table.read_text()
    for row in ("random init", "synthetic only", "synthetic + DP-MAE"):
        assert f"| {row} |" in text
    assert [r.name for r in res["rows"]] == ["random init", "synthetic only",
                                             "synthetic + DP-MAE"]
    # resumed: step 1 loaded, step 2 already complete (same accounting, same weights)
    final = torch.load(out_dir / "dp_mae_final.pt", weights_only=True)
    again = load_example().main(TINY + ["--out-dir", str(out_dir), "--resume"])
    assert "step 1: loaded" in capsys.readouterr().out
    assert again["epsilon"] == pytest.approx(res["epsilon"])
    resumed = torch.load(out_dir / "dp_mae_final.pt", weights_only=True)
    assert all(torch.equal(final[k], resumed[k]) for k in final)


def test_example_refuses_missing_data_dir():
    with pytest.raises(SystemExit):
        load_example().parse_args(["--data", "folder"])


class _Stop(Exception):
    pass


def test_example_training_randomness_is_secret_by_default(tmp_path):
    """``--seed`` fixes the public randomness only: without ``--mask-seed`` both steps get None
    (secret masks and order, from OS entropy); with it, the seed."""
    module = load_example()
    seen = {}

    def pretrain_synthetic(*args, seed, **kwargs):
        seen["step 1"] = seed
        return []

    def dp_mae_train(*args, mask_seed, **kwargs):
        seen["step 2"] = mask_seed
        raise _Stop

    module.pretrain_synthetic, module.dp_mae_train = pretrain_synthetic, dp_mae_train
    for extra, expected in (([], None), (["--mask-seed", "5"], 5)):
        with pytest.raises(_Stop):
            module.main(TINY + ["--seed", "3", "--out-dir", str(tmp_path)] + extra)
        assert seen == {"step 1": expected, "step 2": expected}
