"""The probe runner behind examples/linear_probe.py and `private-engine probe`."""
import argparse
import json
import math

import pytest

from private_engine.heads.probe import (METHODS, add_probe_arguments, format_table, probe_sweep,
                                       run_probe)
from private_engine.heads.probe import _synthetic
from private_engine.randomness import ReproducibleRandomnessWarning


def parse(argv):
    parser = argparse.ArgumentParser()
    add_probe_arguments(parser)
    return parser.parse_args(argv)


def test_arguments_and_defaults():
    args = parse([])
    assert args.dataset == "digits" and args.features == "backbone" and not args.pretrained
    assert args.epsilons[-1] == math.inf and set(args.methods) == set(METHODS)
    assert parse(["--epsilons", "0.5", "inf"]).epsilons == [0.5, math.inf]
    with pytest.raises(SystemExit):
        parse(["--epsilons", "-1"])


def test_sweep_and_table():
    X, y = _synthetic(900, 8, 5, seed=1)
    with pytest.warns(ReproducibleRandomnessWarning, match="noise of DPMeanEstimator"):
        res = probe_sweep(X[:700], y[:700], X[700:], y[700:], methods=["ls", "mean"],
                          epsilons=[0.5, math.inf], seeds=2, progress=False, noise_seed=0)
    assert [len(a) for a in res.accuracies["ls"]] == [2, 1]  # one deterministic non-private fit
    table = format_table(res)
    assert "| DP-LS |" in table and "ε=∞" in table and "±" in table
    assert res.mean("mean")[1] >= res.mean("mean")[0]


def test_run_probe_synthetic_writes_plot_and_json(tmp_path, capsys):
    plot, out = tmp_path / "p.png", tmp_path / "r.json"
    args = parse(["--dataset", "synthetic", "--n-samples", "800", "--n-classes", "5", "--dim", "8",
                  "--epsilons", "1", "inf", "--seeds", "1", "--plot", str(plot), "--json", str(out),
                  "--quiet"])
    assert run_probe(args) == 0
    text = capsys.readouterr().out
    assert "| DP-FC |" in text and "| DP-Mean |" in text
    assert plot.stat().st_size > 1000
    saved = json.loads(out.read_text())
    assert saved["epsilons"] == [1.0, "inf"] and set(saved["accuracies"]) == set(METHODS)


def test_run_probe_digits_backbone_and_raw(tmp_path, capsys):
    args = parse(["--model", "resnet10t", "--img-size", "16", "--methods", "mean", "ls",
                  "--epsilons", "2", "inf", "--seeds", "1", "--plot", "",
                  "--cache-dir", str(tmp_path / "cache"), "--quiet"])
    assert run_probe(args) == 0
    assert list((tmp_path / "cache").glob("resnet10t-*/features.pt"))  # features were cached
    assert run_probe(args) == 0  # second run reads the cache
    args = parse(["--features", "raw", "--methods", "mean", "--epsilons", "inf", "--plot", "",
                  "--quiet"])
    assert run_probe(args) == 0
    text = capsys.readouterr().out
    assert "raw 8x8 pixels" in text
    row = [line for line in text.splitlines() if line.startswith("| DP-Mean")][-1]
    assert float(row.split("|")[2]) > 80.0  # nearest class mean on raw digits pixels
