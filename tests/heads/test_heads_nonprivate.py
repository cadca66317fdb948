"""ε = ∞ (no noise, no clipping): every head must equal its exact non-private counterpart."""
import math

import numpy as np
import pytest
import torch

from private_engine.heads import (
    DPAdamHead,
    DPFeatureCovariance,
    DPLeastSquares,
    DPMeanEstimator,
    DPNewton,
)


def clustered(n=300, d=8, m=4, seed=0, spread=1.0, scale=3.0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(m, d))
    y = rng.integers(0, m, n)
    X = scale * (centres[y] + spread * rng.normal(size=(n, d)))  # norms ≫ 1: clipping would matter
    return X, y


def onehot(y, m):
    Y = np.zeros((len(y), m))
    Y[np.arange(len(y)), y] = 1
    return Y


@pytest.mark.parametrize("alpha,reg", [(0.1, 0.5), (1.0, 3.0), (0.0, 1.0)])
def test_least_squares_equals_closed_form(alpha, reg):
    X, y = clustered()
    m = 4
    Y = onehot(y, m)
    G = X.T @ X
    expected = np.stack([np.linalg.solve((X * Y[:, [j]]).T @ X + alpha * G
                                         + reg * np.eye(X.shape[1]), X.T @ Y[:, j])
                         for j in range(m)])
    clf = DPLeastSquares(epsilon=math.inf, alpha=alpha, reg=reg).fit(X, y)
    np.testing.assert_allclose(clf.coef_.numpy(), expected, rtol=1e-9, atol=1e-12)
    assert clf.rho_ == math.inf and clf.epsilon_ == math.inf and clf.noise_multiplier_ == 0
    np.testing.assert_allclose(clf.decision_function(X), X @ expected.T, rtol=1e-9, atol=1e-9)


def test_least_squares_multilabel_closed_form():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 6))
    Y = (rng.random((200, 5)) < 0.3).astype(float)
    Y[Y.sum(1) > 2] = 0  # at most k = 2 positives per example
    G = X.T @ X
    expected = np.stack([np.linalg.solve((X * Y[:, [j]]).T @ X + 0.5 * G + 2.0 * np.eye(6),
                                         X.T @ Y[:, j])
                         for j in range(5)])
    clf = DPLeastSquares(noise_multiplier=0.0, alpha=0.5, reg=2.0, k=2).fit(X, Y)
    np.testing.assert_allclose(clf.coef_.numpy(), expected, rtol=1e-9, atol=1e-12)
    assert clf.n_dropped_unknown_label_ == 0
    # a row with more than k positives, or that is not a 0/1 indicator, is in no class: the
    # record is dropped (no error)
    bad = np.vstack([Y, np.ones((1, 5)), np.full((1, 5), 0.5), np.full((1, 5), np.nan)])
    clf = DPLeastSquares(noise_multiplier=0.0, alpha=0.5, reg=2.0, k=2).fit(
        np.vstack([X, np.ones((3, 6))]), bad)
    assert clf.n_dropped_unknown_label_ == 3
    np.testing.assert_allclose(clf.coef_.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_newton_reaches_the_logistic_regression_optimum():
    from sklearn.linear_model import LogisticRegression

    X, y = clustered(n=400, d=6, m=3, spread=1.5, scale=1.0)
    n, lam = len(y), 0.05
    clf = DPNewton(epsilon=math.inf, steps=30, reg=lam).fit(X, y)
    for j in range(3):
        # sklearn: min C Σ ℓ + ½‖w‖²  ⇔  min (1/n) Σ ℓ + (λ/2)‖w‖² with C = 1/(nλ)
        ref = LogisticRegression(C=1.0 / (n * lam), fit_intercept=False, tol=1e-12, max_iter=10_000)
        ref.fit(X, (y == j).astype(int))
        np.testing.assert_allclose(clf.coef_[j].numpy(), ref.coef_[0], rtol=1e-5, atol=1e-7)
    # and the gradient of the regularised objective vanishes
    W = clf.coef_.numpy()
    P = 1 / (1 + np.exp(-X @ W.T))
    grad = (P - onehot(y, 3)).T @ X / n + lam * W
    assert np.abs(grad).max() < 1e-10
    proba = clf.predict_proba(X)
    np.testing.assert_allclose(proba.sum(1), 1.0)


def test_mean_estimator_equals_exact_class_means():
    X, y = clustered(n=250, d=5, m=4)
    X[0] = 0.0  # a zero vector stays zero under normalisation
    U = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-300)
    clf = DPMeanEstimator(epsilon=math.inf).fit(X, y)
    for j in range(4):
        np.testing.assert_allclose(clf.class_means_[j].numpy(), U[y == j].mean(0), rtol=1e-12,
                                   atol=1e-14)
        np.testing.assert_allclose(clf.class_counts_[j].item(), np.sum(y == j))
    # inference is the nearest centre in cosine similarity
    C = np.stack([U[y == j].mean(0) for j in range(4)])
    cos = (U @ C.T) / np.linalg.norm(C, axis=1)
    np.testing.assert_allclose(clf.decision_function(X), cos, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(clf.predict(X), np.argmax(cos, axis=1))


def _torch_objective(X, Y, W, b, loss):
    Z = X @ W.T + (b if b is not None else 0)
    if loss == "sigmoid":
        return (torch.nn.functional.binary_cross_entropy_with_logits(Z, Y, reduction="sum")
                / X.shape[0])
    return -(Y * torch.log_softmax(Z, 1)).sum() / X.shape[0]


@pytest.mark.parametrize("loss", ["sigmoid", "softmax"])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_adam_head_equals_plain_adam(loss, fit_intercept):
    X, y = clustered(n=120, d=5, m=3)
    Xt, Yt = torch.tensor(X), torch.tensor(onehot(y, 3))
    W = torch.zeros(3, 5, dtype=torch.float64, requires_grad=True)
    params = [W]
    b0 = -10.0 if loss == "sigmoid" else 0.0
    b = torch.full((3,), b0, dtype=torch.float64, requires_grad=True) if fit_intercept else None
    if b is not None:
        params.append(b)
    opt = torch.optim.Adam(params, lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    for _ in range(15):  # torch's Adam weight_decay adds λθ to the gradient, as the head does for W
        opt.zero_grad()
        _torch_objective(Xt, Yt, W, b, loss).backward()
        if b is not None:
            b.grad -= 0.01 * b.detach()  # the head does not decay the bias
        opt.step()
    clf = DPAdamHead(epsilon=math.inf, steps=15, lr=0.05, betas=(0.9, 0.99), weight_decay=0.01,
                     loss=loss, fit_intercept=fit_intercept).fit(X, y)
    np.testing.assert_allclose(clf.coef_.numpy(), W.detach().numpy(), rtol=1e-9, atol=1e-12)
    if fit_intercept:
        np.testing.assert_allclose(clf.intercept_.numpy(), b.detach().numpy(), rtol=1e-9,
                                   atol=1e-12)


def test_feature_covariance_steps_are_preconditioned_gradient_steps():
    X, y = clustered(n=150, d=4, m=3)
    Xt, Yt = torch.tensor(X), torch.tensor(onehot(y, 3))
    n, lam, lr = len(y), 0.3, 2.0
    Ginv = torch.linalg.inv(Xt.T @ Xt / n + lam * torch.eye(4, dtype=torch.float64))
    W = torch.zeros(3, 4, dtype=torch.float64)
    b = torch.full((3,), -10.0, dtype=torch.float64)
    for _ in range(4):
        Wr, br = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
        _torch_objective(Xt, Yt, Wr, br, "sigmoid").backward()
        W = W - lr * Wr.grad @ Ginv
        b = b - lr * br.grad
    clf = DPFeatureCovariance(epsilon=math.inf, steps=4, lr=lr, reg=lam).fit(X, y)
    np.testing.assert_allclose(clf.coef_.numpy(), W.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(clf.intercept_.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(clf.noisy_covariance_.numpy(), X.T @ X / n, rtol=1e-12)


def test_feature_covariance_decreases_the_loss_to_logistic_regression_quality():
    from sklearn.linear_model import LogisticRegression

    X, y = clustered(n=400, d=6, m=4, spread=0.5)
    Xt, Yt = torch.tensor(X), torch.tensor(onehot(y, 4))
    losses = []
    for steps in (1, 5, 20, 200):
        clf = DPFeatureCovariance(epsilon=math.inf, steps=steps, lr=4.0, reg=1e-2,
                                  loss="softmax").fit(X, y)
        losses.append(float(_torch_objective(Xt, Yt, clf.coef_, clf.intercept_, "softmax")))
    assert all(a > b for a, b in zip(losses, losses[1:]))
    reference = LogisticRegression(C=1e4, max_iter=5000).fit(X, y).score(X, y)
    assert clf.score(X, y) >= reference - 0.02
