"""private_engine.step_metrics: after every logical step the engine sends ε so far, the batch's
mean loss, its clip fraction and its dropped samples to a TensorBoard SummaryWriter or a callable.

The model is ``L_i = w·x_i + a_i`` with ``w = 0``: the per-sample gradient is ``x_i``, so its norm
(and whether it exceeds R) is set by the data, and the loss is ``a_i`` (an infinite ``a_i`` drops
the sample)."""
import math

import pytest
import torch
from torch import nn

import private_engine as pe
from private_engine.accounting import make_accountant
from private_engine.step_metrics import EpsilonTracker, StepMetrics


def _engine(**kwargs):
    model = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(model.weight)
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=100, max_grad_norm=1.0,
                              noise_multiplier=1.0, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # w stays 0: losses stay a_i
    engine.attach(optimizer)
    return model, engine, optimizer


def _loss(model, norms, offsets):
    x = torch.tensor([[n, 0.0, 0.0] for n in norms])
    return model(x).squeeze(1) + torch.tensor(offsets)


# (physical batches of a logical step): per-sample gradient norms and losses
STEPS = [
    [([0.5, 2.0, 3.0], [1.0, 2.0, 3.0])],
    [([0.1, 0.2], [4.0, 6.0]), ([5.0, 0.3], [math.inf, 8.0])],  # virtual step + step; one drop
    [([4.0, 4.0, 0.5, 0.5], [0.0, 0.0, 1.0, 1.0])],
]
EXPECTED = [  # (mean finite loss, clip fraction, dropped, samples)
    (2.0, 2 / 3, 0, 3),
    (6.0, 0 / 4, 1, 4),  # the dropped sample's norm is not counted as clipped
    (0.5, 2 / 4, 0, 4),
]


def _run(model, engine, optimizer):
    epsilons = []
    for batches in STEPS:
        for k, (norms, offsets) in enumerate(batches):
            loss = _loss(model, norms, offsets)
            if k < len(batches) - 1:
                optimizer.virtual_step(loss=loss)
            else:
                optimizer.step(loss=loss)
        epsilons.append(engine.get_epsilon())
    return epsilons


def test_tensorboard_log_has_epsilon_and_loss_of_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    model, engine, optimizer = _engine(step_logger=writer)
    epsilons = _run(model, engine, optimizer)
    writer.close()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}
    assert [s for s, _ in scalars["privacy/epsilon"]] == [1, 2, 3]
    assert [v for _, v in scalars["privacy/epsilon"]] == pytest.approx(epsilons, rel=1e-6)
    assert epsilons[0] > 0 and epsilons[0] < epsilons[1] < epsilons[2]
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([e[0] for e in EXPECTED])
    assert [v for _, v in scalars["train/clip_fraction"]] == pytest.approx(
        [e[1] for e in EXPECTED])
    assert [v for _, v in scalars["train/dropped_samples"]] == [e[2] for e in EXPECTED]
    assert [v for _, v in scalars["train/samples"]] == [e[3] for e in EXPECTED]


def test_a_callable_gets_the_metrics_of_every_step():
    got = []
    model, engine, optimizer = _engine()
    fn = engine.add_step_logger(got.append)
    epsilons = _run(model, engine, optimizer)
    assert all(isinstance(m, StepMetrics) for m in got)
    assert [m.step for m in got] == [1, 2, 3]
    # exact: the RDP of one step, scaled by the step count, is what the accountant composes
    assert [m.epsilon for m in got] == epsilons
    assert epsilons[-1] == engine.accountant.get_epsilon(delta=engine.target_delta)
    assert engine.get_epsilon(1e-3) == engine.accountant.get_epsilon(delta=1e-3)
    assert all(m.delta == engine.target_delta for m in got)
    assert [(m.loss, m.clip_fraction, m.dropped_samples, m.samples) for m in got] == [
        pytest.approx(e) for e in EXPECTED]
    assert got[0].as_dict()["clip_fraction"] == pytest.approx(2 / 3)
    engine.remove_step_logger(fn)
    optimizer.step(loss=_loss(model, [1.0], [0.0]))
    assert len(got) == 3


def test_other_accountants_compute_epsilon_every_k_steps():
    got = []
    model, engine, optimizer = _engine(accountant="gdp")
    engine.add_step_logger(got.append, epsilon_every=2)
    epsilons = _run(model, engine, optimizer)
    assert [m.epsilon for m in got] == [epsilons[0], epsilons[1], None]
    with pytest.raises(ValueError, match="epsilon_every"):
        engine.add_step_logger(got.append, epsilon_every=0)
    with pytest.raises(TypeError, match="SummaryWriter"):
        engine.add_step_logger("runs/dp")


def test_the_rdp_tracker_equals_the_accountant_over_changing_parameters():
    accountant = make_accountant("rdp")
    tracker = EpsilonTracker(lambda: accountant, 1e-5)
    assert tracker(0) == 0.0
    for step, (sigma, q) in enumerate([(1.0, 0.01)] * 5 + [(2.0, 0.02)] * 3 + [(1.0, 0.01)], 1):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
        assert tracker(step) == accountant.get_epsilon(delta=1e-5)


def test_step_metrics_are_logged_at_debug(caplog):
    model, engine, optimizer = _engine()
    with caplog.at_level("DEBUG", logger="private_engine.step_metrics"):
        optimizer.step(loss=_loss(model, [2.0, 0.5], [1.0, 3.0]))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "private_engine.step_metrics"]
    assert "step 1:" in line and "loss=2" in line and "clip fraction=0.5" in line


def test_get_epsilon_reuses_the_one_step_rdp_curve(monkeypatch):
    """With the RDP accountant the per-order RDP of a step is computed once per (σ, q), not at
    every call (it costs tens of milliseconds; the conversion to ε is cheap)."""
    from opacus.accountants.analysis import rdp as rdp_analysis

    calls = []
    compute_rdp = rdp_analysis.compute_rdp
    monkeypatch.setattr(rdp_analysis, "compute_rdp",
                        lambda **kw: calls.append(kw) or compute_rdp(**kw))
    model, engine, optimizer = _engine()
    values = []
    for _ in range(3):
        optimizer.step(loss=_loss(model, [1.0], [0.0]))
        values += [engine.get_epsilon(), engine.get_epsilon(1e-3)]
    assert len(calls) == 1 and calls[0]["steps"] == 1
    monkeypatch.setattr(rdp_analysis, "compute_rdp", compute_rdp)
    assert values[-2:] == [engine.accountant.get_epsilon(delta=d)
                           for d in (engine.target_delta, 1e-3)]
