"""Red-team round 3: the batch flow's guesses, re-entries and roots, the state guard's arming, the
secret randomness's swap, and position/size-dependent losses, attacked.

Same contract and harness as tests/privacy/test_privacy_under_attack.py: noise 0, SGD at lr 1,
one step with and without the attacker's sample (same other samples, declared batch size B)::

    ratio = B·‖Δ(released)‖ / R  ≤  1 + 1e-6

or both runs refused with a ValueError before anything is released (a refusal for one batch and
not for the other depends on the data). Every test here FAILS on the tree it was written against
(main at 4f0e481): each is a break, with the ratio, the data-dependent refusal or the predictable
mask in its message.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from test_red_team_round2 import DropoutModel, centred_mean, native_custom, opacus_custom, pair_of
from torch import nn

import private_engine as pe
from test_privacy_under_attack import (
    DOOR_IDS,
    DOORS,
    MODES,
    B,
    CapturingSGD,
    Case,
    R,
    assert_bounded,
    honest_vectors,
    large_vector_case,
    mlp,
    mse,
    refused,
    released,
    run_pair,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore")]

NATIVE_AND_HOOKS = [("native", m) for m in MODES] + [("opacus", "hooks")]
NATIVE_AND_HOOKS_IDS = [f"{d}-{h}" for d, h in NATIVE_AND_HOOKS]


# -- 1. labels broadcast along a non-batch dim are dropped as "a constant of the batch's size" ---
def labels_across(y, t):
    """Sample i's loss takes ``⟨y_i, Σ_k t_k⟩``: the targets ``t`` (n, 4), broadcast against
    ``y[:, None, :]`` (n, 1, 4), land on output dim 1 and are summed there over the batch."""
    return (y[:, None, :] * t).sum((1, 2)) + mse(y, t)


def labels_case() -> Case:
    model = mlp()
    return Case(model, honest_vectors(model), (torch.zeros(1, 8), torch.full((1, 4), 100.0)),
                loss=labels_across)


@pytest.mark.parametrize("door,how", NATIVE_AND_HOOKS, ids=NATIVE_AND_HOOKS_IDS)
def test_labels_broadcast_along_another_dim_are_taken_for_a_constant(door, how):
    """``BatchFlow._entry`` takes the untagged targets (leading size n) for per-sample rows with
    ``guessed=True``; ``rules.aligned`` then *drops* a guessed operand whose batch dim lands on
    another output dim than the certain rows' ("a constant whose size matches the batch, along
    another dim"). Real labels broadcast that way and reduced over that dim give every sample's
    loss the whole batch's labels: the attacker's target scales every honest gradient.
    Measured 4.50 in every mode and in the hooks door."""
    assert_bounded(*run_pair(labels_case(), door, how), may_refuse=True,
                   what=f"labels across {door}-{how}")


def test_labels_broadcast_along_another_dim_in_the_opacus_criterion():
    """The same through the Opacus door's criterion: ``z = y + mean_k(y[:, None] * t)``
    (rows of y only, once the labels are dropped) passes ``check_loss``. Measured 4.15."""
    case = labels_case()

    def body(out, x, t):
        y = out[0](x)
        z = y + (y[:, None, :] * t).mean(1)
        n, k = z.shape[0], z[0].numel()
        (out[2](z.reshape(-1), t.reshape(-1), shape=(n, k)) * k).backward()

    assert_bounded(*pair_of(opacus_custom, case, "ghost", body), may_refuse=True,
                   what="labels across, criterion")


# -- 2. a second forward of the model re-tags its (mixed) input as fresh rows --------------------
def second_forward(model, x, t):
    """Two forwards of the same model in one step, the second on the batch reversed (a
    mixup/pairing objective): sample i's loss reads sample n−1−i's input."""
    return mse(model(x), t) + mse(model(x.flip(0)), t)


@pytest.mark.parametrize("door,how", NATIVE_AND_HOOKS, ids=NATIVE_AND_HOOKS_IDS)
def test_a_second_forward_relabels_a_mixed_input_as_the_batch(door, how):
    """``x.flip(0)`` is ``Mixed`` (``rules.flip_roll``), but ``BatchFlow._pre_model`` on a
    forward of the same batch size inside an open region calls ``_open``, which ``_set``s every
    argument of that size to ``Rows(0, 1, 0, n)`` — overwriting the Mixed tag. Any mixing done
    before a re-entry of the model (flip, roll, ``x - x.mean(0)``, the previous call's output)
    is laundered. Measured 1.72 in every mode and in the hooks door."""
    case = large_vector_case()
    if door == "native":
        pair = pair_of(native_custom, case, how, second_forward)
    else:
        pair = pair_of(opacus_custom, case, how,
                       lambda out, x, t: second_forward(out[0], x, t).mean().backward())
    assert_bounded(*pair, may_refuse=True, what=f"second forward {door}-{how}")


# -- 3. the Opacus door's plain backward: roots that the wrapper never sees -----------------------
def test_opacus_autograd_grad_is_not_checked():
    """``torch.autograd.grad(loss, params)`` instead of ``loss.backward()``: the wrapper of
    ``torch.autograd.backward`` records no roots, and the ``last_scalar`` fallback of
    ``BatchFlow.check_root`` points at the ``ones_like(loss)`` that autograd's ``_make_grads``
    creates (a 0-dim float output of an input that requires grad, untagged), so the Mixed loss
    is never looked at; the engine's hooks still write the clipped sums into ``p.grad`` and the
    optimizer releases them. Centring on the batch mean (refused with ``backward()``):
    ratio 3.09."""
    model = mlp()
    case = Case(model, honest_vectors(model), large_vector_case().crafted)

    def body(out, x, t):
        loss = centred_mean(out[0](x), t)
        torch.autograd.grad(loss, [p for p in out[0].parameters() if p.requires_grad])

    assert_bounded(*pair_of(opacus_custom, case, "hooks", body), may_refuse=True,
                   what="autograd.grad")


def pair_rows_body(out, x, t):
    """Each sample's loss plus its dot product with the (detached) output of the sample k rows
    away, k sharing a factor with n (n/2 for even n, n/3 else)."""
    y = out[0](x)
    n = y.shape[0]
    k = n // 2 if n % 2 == 0 else n // 3
    (mse(y, t) + 3 * (y * y.roll(k, 0).detach()).sum(1)).mean().backward()


def test_a_sum_over_the_batch_forgets_its_rows_modulus():
    """``y * y.roll(k, 0)`` with ``gcd(k, n) > 1`` joins to ``Rows(mod=gcd)`` (the convention for
    stacked views of a batch: rows r and r+k "may be one sample"); the mean over the batch makes
    it ``Summed``, which carries no modulus, and ``check_root`` accepts any Summed root (and any
    Rows root, whatever its modulus): in the hooks door every row is a sample, so rows r and r+k
    are two. 8 honest samples + the attacker (k = 4 / k = 3): ratio 1.59."""
    model = mlp()
    case = Case(model, honest_vectors(model, n=8), large_vector_case().crafted)
    assert_bounded(*pair_of(opacus_custom, case, "hooks", pair_rows_body), may_refuse=True,
                   what="rows modulus, 8 + 1")


def test_a_rows_modulus_makes_the_hooks_refusal_depend_on_the_batch_size():
    """The same loss with 3 honest samples: with the attacker (n = 4, k = 2, mod 2) it trains,
    without it (n = 3, k = 1) it is refused: whether the step ran reveals the attacker."""
    model = mlp()
    case = Case(model, honest_vectors(model), large_vector_case().crafted)
    assert_bounded(*pair_of(opacus_custom, case, "hooks", pair_rows_body), may_refuse=True,
                   what="rows modulus, 3 + 1")


# -- 4. a value kept from an earlier step, copied between steps ----------------------------------
def two_steps(model, mode, first, second, launder: bool):
    """Step 1 on ``first`` keeps ``stash`` (its outputs' batch mean, detached); the weights are
    reset (public) and step 2 on ``second`` trains on ``y - 3·stash``. Returns step 2's release."""
    model = copy.deepcopy(model)
    init = copy.deepcopy(model.state_dict())
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    y = model(first[0])
    stash = y.detach().mean(0)
    opt.step(loss=mse(y, first[1]))
    if launder:
        stash = stash.clone()  # between the steps: no region is open
    model.load_state_dict(init)
    try:
        opt.step(loss=mse(model(second[0]) - 3 * stash, second[1]))
    except ValueError as e:
        return refused(e, "step", None)
    return released(model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_value_kept_from_an_earlier_step_is_laundered_by_a_copy(mode):
    """Kept as is, the stash is refused at step 2 (``_STALE``: tagged in epoch 1). One
    ``.clone()`` between the steps — no region is open, the tracker is off the dispatch stack —
    gives an untagged tensor, taken in step 2 for a constant: step 2's release (same honest
    batch, same weights) depends on the attacker of step 1. Ratio 2.06."""
    case = large_vector_case()
    pair = tuple(two_steps(case.model, mode, batch, case.honest, launder=True)
                 for batch in (case.with_sample, case.honest))
    assert_bounded(*pair, may_refuse=True, what=f"stash across steps {mode}")


# -- 5. state the step writes where the state guard does not look --------------------------------
class LazyStatistic(nn.Module):
    """A buffer registered lazily at the first training forward, from that batch (a lazily
    initialised normaliser): the module owned no buffer when the guards were installed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        if self.training and torch.is_grad_enabled() and "center" not in self._buffers:
            self.register_buffer("center", x.detach().mean(0))
        return self.fc(x)


class InputEMA(nn.Module):
    """A buffer the loop (or a global forward pre-hook) updates from the batch just before the
    forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        return self.fc(x)


def _ema_prehook(module, args):
    if isinstance(module, InputEMA) and module.training:
        with torch.no_grad():
            module.ema.mul_(0.9).add_(0.1 * args[0].mean(0))


STATE_DOORS = [("native", "bk"), ("native", "ghost"), ("opacus", "hooks"), ("opacus", "ghost")]


@pytest.mark.parametrize("door,how", STATE_DOORS, ids=[f"{d}-{h}" for d, h in STATE_DOORS])
def test_a_buffer_registered_during_the_step_is_released(door, how):
    """``StepStateGuard.arm`` builds its list of slots once, at the step's first forward pre-hook,
    before the forward registers the buffer; ``BufferGuard`` hooks only modules that owned
    buffers at ``install()`` (its docstring's "Not seen"). The buffer holds the batch's mean input
    and ships with the release: ratio 84.9."""
    model = LazyStatistic()
    case = Case(model, honest_vectors(model), (torch.full((1, 8), 30.0), torch.zeros(1, 4)))
    assert_bounded(*run_pair(case, door, how), may_refuse=True, what=f"lazy buffer {door}-{how}")


@pytest.mark.parametrize("door,how", STATE_DOORS, ids=[f"{d}-{h}" for d, h in STATE_DOORS])
def test_a_buffer_written_before_the_first_forward_hook_is_released(door, how):
    """``StepStateGuard`` records versions at the step's first forward *pre-hook* (prepended on
    the model); a global forward pre-hook (``register_module_forward_pre_hook``, run before every
    module's own) — or the loop itself, before calling the model — writes the buffer first, so
    the recorded version is the written one. ``BufferGuard`` brackets the module's forward only.
    An EMA of the inputs ships with the release: ratio 8.55."""
    model = InputEMA()
    case = Case(model, honest_vectors(model), (torch.full((1, 8), 30.0), torch.zeros(1, 4)))
    handle = nn.modules.module.register_module_forward_pre_hook(_ema_prehook)
    try:
        pair = run_pair(case, door, how)
    finally:
        handle.remove()
    assert_bounded(*pair, may_refuse=True, what=f"ema before the forward {door}-{how}")


def _assert_step_masks_are_secret(model, opt, x, t, what):
    """Seed torch publicly (as a script does), take one step and check that the forward's dropout
    mask is not the replay of that public seed."""
    torch.manual_seed(1234)
    y = model(x)
    mask = y == 0
    opt.step(loss=mse(y, t))
    assert opt.steps == 1
    torch.manual_seed(1234)
    replay = F.dropout(torch.ones(B, 8), 0.5, training=True) == 0
    assert not torch.equal(mask, replay), what


# -- 6. secret randomness: a swap that is never undone or never done -----------------------------
def test_a_failed_loss_leaves_the_next_steps_masks_to_the_public_seed():
    """``SecretModelRandomness._pre`` swaps only when ``_saved is None``; ``end()`` runs at the
    engine's step, at a no-grad forward or when the forward raises — not when the user's loss
    raises after the forward. The loop catches the error and re-seeds publicly
    (``torch.manual_seed``); the next step's forward finds ``_saved`` set, does not swap, and its
    dropout masks are the replay of the public seed. (The step's ``end()`` then restores the
    state saved before the failed step, undoing the user's re-seed.)"""
    model = DropoutModel()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    x, t = torch.ones(B, 8), torch.zeros(B, 8)
    model(x)
    try:
        raise FloatingPointError("the loss of a bad batch")  # the user's loss fails; skipped
    except FloatingPointError:
        pass
    _assert_step_masks_are_secret(
        model, opt, x, t, "after a failed loss the next step's dropout draws from the public "
        "generator: its mask is the replay of torch.manual_seed(1234)")


class AlwaysDropout(nn.Module):
    """Dropout applied whatever the mode (``F.dropout(..., training=True)``: MC dropout, noise
    injection)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, training=True)


def test_randomness_of_a_model_trained_in_eval_mode_is_public():
    """``SecretModelRandomness._pre`` swaps only for a module in training mode; the engine trains
    a model left in eval mode (the step is released) and its forward's draws come from the
    public generator: the masks replay ``torch.manual_seed(1234)``."""
    model = AlwaysDropout().eval()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    x, t = torch.ones(B, 8), torch.zeros(B, 8)
    _assert_step_masks_are_secret(
        model, opt, x, t, "a model trained in eval mode draws its masks from the public generator")


# -- 7. losses that depend on where a sample sits, or on how many there are ----------------------
def aligned_case(offset: float, attacker_sign: float, loss: Callable):
    """Honest samples whose gradients are below R and point one way (targets offset along u),
    the attacker's large and along (sign +1) or against (−1) theirs; the attacker comes FIRST in
    its batch (an inserted record shifts the others)."""
    model = mlp()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=g) * 0.1
    u = torch.randn(4, generator=g)
    u = u / u.norm()
    with torch.no_grad():
        t = model(x) - offset * u
    xa = torch.randn(1, 8, generator=g) * 0.1
    with torch.no_grad():
        ta = model(xa) - attacker_sign * 50 * u
    case = Case(model, (x, t), (xa, ta), loss=loss)
    return case, (torch.cat([xa, x]), torch.cat([ta, t]))


def position_weighted(y, t):
    """Per-sample losses weighted by position in the batch (a schedule over the batch)."""
    return mse(y, t) * (1 + torch.arange(y.shape[0]))


def over_batch_size(y, t):
    """Per-sample losses divided by the physical batch size (a "mean" of the per-sample losses,
    handed to the engine as a vector)."""
    return mse(y, t) * 3.0 / y.shape[0]


@pytest.mark.parametrize("door,how", NATIVE_AND_HOOKS, ids=NATIVE_AND_HOOKS_IDS)
def test_an_arange_is_not_data_free(door, how):
    """``Iota`` (``arange(n)``) is "positions only: no sample's data" (``_result``, ``aligned``,
    ``summed``), and an arange through arithmetic becomes an untagged constant; but a sample's
    position is the number of samples before it. One record inserted first shifts every honest
    weight ``1 + i`` by one: ratio 1.70."""
    case, with_batch = aligned_case(0.1, +1.0, position_weighted)
    assert_bounded(*run_pair(case, door, how, with_batch=with_batch), may_refuse=True,
                   what=f"position weights {door}-{how}")


#: the batch size reaches the loss as a Python number (``y.shape[0]``): not followed, a documented
#: limit (docs/engine.md, "Limits")
@pytest.mark.xfail(strict=True, reason="documented limit: Python numbers such as the batch size")
@pytest.mark.parametrize("door,how", NATIVE_AND_HOOKS, ids=NATIVE_AND_HOOKS_IDS)
def test_dividing_the_per_sample_losses_by_the_batch_size(door, how):
    """``loss_i · 3 / n`` with ``n = y.shape[0]`` (a Python int: the documented Python-number
    limit, but the commonest way to write it): the attacker's presence moves n from 3 to 4 and
    rescales every unclipped honest gradient before clipping. Ratio 1.59."""
    case, with_batch = aligned_case(0.3, -1.0, over_batch_size)
    assert_bounded(*run_pair(case, door, how, with_batch=with_batch), may_refuse=True,
                   what=f"over n {door}-{how}")


# -- 8. an alias that is not a view keeps its rows through an in-place mixing write --------------
def detach_alias_then_write(h):
    """``out = h.detach()`` shares h's storage but is no view (``_base`` is None); h is then
    centred on the batch mean in place: ``out`` holds the mixed values."""
    h = h * 1
    out = h.detach()
    h.sub_(3 * h.detach().mean(0))
    return out


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_a_detached_alias_keeps_its_rows_after_an_in_place_mixing_write(door, how):
    """Round 2 fixed views (``_writes`` keyed by ``t._base``); ``detach()`` (and any other alias
    that is not a view) shares the storage without a ``_base``, so ``_entry`` never compares it
    with the write: it keeps ``Rows`` while its storage now holds ``h - 3·mean(h)``. The second
    layer trains on the centred activations: ratio 3.14 in every mode and door."""
    from test_red_team_round2 import coupled_case
    case = coupled_case(detach_alias_then_write)
    assert_bounded(*run_pair(case, door, how), may_refuse=True, what=f"detach alias {door}-{how}")


# -- 9. the feature heads: what the fit reveals besides the noised statistics -------------------
def _heads():
    from private_engine.heads import (
        DPAdamHead,
        DPFeatureCovariance,
        DPLeastSquares,
        DPMeanEstimator,
        DPNewton,
    )
    return {"least_squares": DPLeastSquares, "mean": DPMeanEstimator, "newton": DPNewton,
            "adam": DPAdamHead, "covariance": DPFeatureCovariance}


def _head_data():
    import numpy as np
    g = np.random.default_rng(0)
    return g.normal(size=(20, 5)), g.integers(0, 2, 20)


def _head_fit(H, X, y, **kw):
    """``("fitted", releases)`` or ``("refused", message)``: the releases are every tensor and
    array the fitted head publishes (``classes_``, coefficients, noisy statistics)."""
    import numpy as np
    try:
        clf = H(noise_multiplier=1.0, random_state=0, **kw).fit(X, y)
    except ValueError as e:
        return "refused", str(e)
    out = {"classes_": torch.as_tensor(np.asarray(clf.classes_))}
    for k, v in vars(clf).items():
        if k.endswith("_") and isinstance(v, torch.Tensor):
            out[k] = v
    return "fitted", out


def _head_pair_is_bounded(with_record, without, what):
    """Both refused for the same reason, or both fitted with the same releases: the record,
    dropped, moves nothing (ratio 0), and the fit's outcome does not depend on it."""
    assert with_record[0] == without[0], (
        f"{what}: the refusal depends on the data: with the record {with_record}, without it "
        f"{without}")
    if with_record[0] == "refused":
        assert with_record[1] == without[1]
        return
    a, b = with_record[1], without[1]
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), (
            f"{what}: {k} moved: {a[k].tolist()} with the record, {b[k].tolist()} without")


@pytest.mark.parametrize("head", list(_heads()))
def test_a_head_releases_the_set_of_labels_of_the_private_data(head):
    """``encode_labels`` with ``classes=None`` (the default) took ``np.unique(y)`` of the private
    labels, and ``classes_`` (and the number of released class blocks) was published without
    noise and without a warning: one record with a label no one else has adds it — the record's
    presence and label are revealed with certainty (ε = ∞). A private fit must take the label
    set from the settings (or be refused for them), and a record with a label outside it must
    change nothing — no refusal either."""
    import numpy as np
    X, y = _head_data()
    H = _heads()[head]
    Xa, ya = np.vstack([X, np.ones(5)]), np.append(y, 7)
    for kw in ({}, {"classes": [0, 1]}):
        _head_pair_is_bounded(_head_fit(H, Xa, ya, **kw), _head_fit(H, X, y, **kw),
                              f"{head} {kw}")


@pytest.mark.parametrize("head", list(_heads()))
def test_a_head_refuses_a_data_set_with_one_non_finite_record(head):
    """``fit`` raised "X contains NaN or infinite values" when one record is not finite and fit
    without it: the refusal depends on one record (the training step instead drops such a
    sample, ratio 0). A non-finite record must contribute nothing within the sensitivity, and
    the fit must not depend on it."""
    import numpy as np
    X, y = _head_data()
    H = _heads()[head]
    for bad in (np.full(5, np.inf), np.array([0.0, np.nan, 1.0, 2.0, 3.0])):
        _head_pair_is_bounded(_head_fit(H, np.vstack([X, bad]), np.append(y, 0), classes=[0, 1]),
                              _head_fit(H, X, y, classes=[0, 1]), f"{head} {bad.tolist()}")
