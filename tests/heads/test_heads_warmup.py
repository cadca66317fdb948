"""Seed 003 Algorithm 2: DP class centres as a prior, residual loss, DP fine-tuning with the engine,
and the composed privacy guarantee (ε₁ + ε₂, δ₁ + δ₂)."""
import copy
import math

import pytest
import torch
from torch import nn

from private_engine.heads.warmup import (
    WarmupClassifier,
    residual_loss,
    warmup_accuracy,
    warmup_finetune,
)


def test_residual_loss_formula_and_gradient():
    torch.manual_seed(0)
    g = torch.randn(6, 4, requires_grad=True)
    h = torch.randn(6, 4)
    y = torch.tensor([0, 1, 2, 3, 1, 0])
    loss = residual_loss(g, h, y)
    naive = -torch.log(0.5 * torch.softmax(g, 1)[torch.arange(6), y]
                       + 0.5 * torch.softmax(h, 1)[torch.arange(6), y])
    torch.testing.assert_close(loss, naive)
    assert loss.shape == (6,) and bool((loss >= 0).all())  # a KL to a one-hot target
    loss.sum().backward()
    assert g.grad is not None and torch.isfinite(g.grad).all()
    torch.testing.assert_close(residual_loss(g, h, y, reduction="mean"), naive.mean())
    # when the prior is already certain of the right class the residual loss is ~log 2 at worst
    confident = torch.full((1, 4), -50.0)
    confident[0, 2] = 50.0
    assert float(residual_loss(torch.zeros(1, 4), confident,
                               torch.tensor([2]))) < math.log(2) + 1e-6
    with pytest.raises(ValueError, match="reduction"):
        residual_loss(g, h, y, reduction="avg")


def test_warmup_classifier_combines_model_and_prior():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    extractor = copy.deepcopy(model)
    centres = torch.nn.functional.normalize(torch.randn(2, 8), dim=1)
    clf = WarmupClassifier(model, extractor, centres, temperature=0.5)
    x = torch.randn(5, 3)
    phi = torch.nn.functional.normalize(extractor[1](extractor[0](x)), dim=1)
    h = phi @ centres.T / 0.5
    expected = torch.log(0.5 * torch.softmax(model(x), 1) + 0.5 * torch.softmax(h, 1))
    torch.testing.assert_close(clf(x), expected)


def _task(n=700, d=10, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = 2.5 * torch.randn(m, d, generator=g)
    y = torch.randint(0, m, (n,), generator=g)
    return centres[y] + torch.randn(n, d, generator=g), y


def test_warmup_finetune_end_to_end_composes_privacy():
    X, y = _task()
    Xtr, ytr, Xte, yte = X[:560], y[:560], X[560:], y[560:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    initial = copy.deepcopy(model.state_dict())
    res = warmup_finetune(model, Xtr, ytr, epsilon_centres=1.0, delta_centres=1e-6,
                          epsilon_train=2.0, delta_train=1e-6, epochs=2, batch_size=140, lr=5e-3,
                          max_grad_norm=1.0, eval_data=(Xte, yte),
                          progress=False)  # secret noise and batches
    # Theorem 2.5: (ε1 + ε2, δ1 + δ2), with ε2 what the engine's accountant actually spent
    assert res.epsilon_centres == pytest.approx(1.0, rel=1e-6)
    assert 0 < res.epsilon_train <= 2.0 * (1 + 1e-3)
    assert res.epsilon == pytest.approx(res.epsilon_centres + res.epsilon_train)
    assert res.delta == pytest.approx(2e-6)
    assert res.centres.noise_std_ > 0 and res.engine.noise_multiplier > 0
    # the model was trained, the prior's feature extractor was not
    assert any(not torch.equal(p, initial[k]) for k, p in model.state_dict().items())
    for k, p in res.classifier.feature_extractor.state_dict().items():
        assert torch.equal(p, initial[k])
    assert len(res.history) == 2 and "test_accuracy" in res.history[-1]
    acc = warmup_accuracy(res.classifier, Xte, yte)
    assert acc > 0.6  # chance is 0.25


def test_warmup_argument_errors():
    X, y = _task(n=50)
    model = nn.Sequential(nn.Linear(10, 4))
    # no record left once those outside the label set are dropped: the empty data set
    with pytest.raises(ValueError, match="no record has a label in 0..3"):
        warmup_finetune(model, X, y + 4, epsilon_centres=1, delta_centres=1e-5, epsilon_train=1,
                        delta_train=1e-5, progress=False)
    with pytest.raises(ValueError, match="epochs"):
        warmup_finetune(model, X, y, epsilon_centres=1, delta_centres=1e-5, epsilon_train=1,
                        delta_train=1e-5, epochs=0, progress=False)


def test_warmup_drops_records_outside_the_label_set():
    """A label outside 0..K−1 (K: the model's outputs, public) drops its record from both stages,
    without an error: refusing it would reveal the record."""
    X, y = _task(n=60)
    y = y.clone()
    y[:3] = torch.tensor([4, -1, 100])
    model = nn.Sequential(nn.Linear(10, 4))
    res = warmup_finetune(model, X, y, epsilon_centres=1, delta_centres=1e-5, epsilon_train=4,
                          delta_train=1e-5, epochs=1, batch_size=30, progress=False)
    assert res.n_dropped_unknown_label == 3
    assert res.centres.n_dropped_unknown_label_ == 0  # dropped before the centres
    assert res.centres.classes_.tolist() == [0, 1, 2, 3]
