"""The probe runner behind examples/linear_probe.py and `private-engine probe`."""
import argparse
import json
import math

import numpy as np
import pytest

from private_engine.commands.probe import (
    add_probe_arguments,
    load_probe_data,
    probe_classes,
    run_probe,
)
from private_engine.commands.probe import synthetic_clusters as _synthetic
from private_engine.foundation.randomness import ReproducibleRandomnessWarning
from private_engine.heads.probe import METHODS, format_table, probe_sweep


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


def test_probe_data_names_its_parts():
    args = parse(["--dataset", "synthetic", "--n-samples", "100", "--n-classes", "3", "--dim", "4",
                  "--test-fraction", "0.2"])
    data = load_probe_data(args)
    assert data.X_train.shape == (80, 4) and data.y_train.shape == (80,)
    assert data.X_test.shape == (20, 4) and data.y_test.shape == (20,)
    assert data.description.startswith("synthetic clusters: n=100, d=4")


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


@pytest.fixture
def fitted_label_sets(monkeypatch):
    """The ``classes`` setting of every head the probe fits, with the labels it was fitted on."""
    from private_engine.heads.base import DPHeadBase

    seen = []
    original = DPHeadBase.fit

    def fit(self, X, y):
        seen.append((type(self).__name__, self.classes, set(np.asarray(y).tolist())))
        return original(self, X, y)

    monkeypatch.setattr(DPHeadBase, "fit", fit)
    return seen


def test_the_sweep_never_takes_the_label_set_from_the_training_labels(fitted_label_sets):
    """Every fit gets a public label set: ``classes=``, or the test labels (scored without noise
    by the sweep); a training label outside it drops its record instead of adding a class."""
    X, y = _synthetic(300, 6, 4, seed=2)
    y_train = y[:200].copy()
    y_train[0] = 9  # a label only the private training data has
    res = probe_sweep(X[:200], y_train, X[200:], y[200:], epsilons=[1.0], seeds=1,
                      progress=False)
    assert set(res.accuracies) == set(METHODS)
    assert len(fitted_label_sets) == len(METHODS)
    for name, classes, _ in fitted_label_sets:
        assert classes is not None and sorted(np.asarray(classes).tolist()) == [0, 1, 2, 3], name
    fitted_label_sets.clear()
    probe_sweep(X[:200], y[:200], X[200:], y[200:], methods=["mean"], epsilons=[1.0], seeds=1,
                progress=False, classes=range(6))
    assert [list(c) for _, c, _ in fitted_label_sets] == [list(range(6))]


def test_the_probe_label_set_comes_from_the_dataset_definition():
    assert probe_classes(parse([])).tolist() == list(range(10))
    args = parse(["--dataset", "synthetic", "--n-classes", "7"])
    assert probe_classes(args).tolist() == list(range(7))
