"""What bad input gets: clear errors, and a failed step leaves the model parameters, the optimizer
state, the accumulated sums and the accountant untouched."""
import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import gen_for, make_engine, tanh_clip

pytestmark = pytest.mark.usefixtures("one_thread")

REDUCTION = 'reduction="none"'


def _setup(opt_cls=torch.optim.Adam, clip="abadi", noise=0.0, B=4, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    engine = make_engine(model, B, clip=clip, R=0.5, noise_multiplier=noise)
    opt = opt_cls(model.parameters(), lr=0.1)
    engine.attach(opt)
    gen = gen_for(seed)
    x = torch.randn(B, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (B,), generator=gen)
    return model, engine, opt, x, y


def _loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _snapshot(model, opt, engine):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "opt": copy.deepcopy(opt.state_dict()),
        "history": list(engine.accountant.history),
        "sums": [None if s.grad_sums is None else [g.clone() for g in s.grad_sums.grads]
                 for s in engine._attached],
        "samples": [s.samples for s in engine._attached],
    }


def _assert_same(a, b):
    assert len(a["params"]) == len(b["params"])
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q), "parameters changed by a failed step"
    for p, q in zip(a["grads"], b["grads"]):
        assert (p is None and q is None) or torch.equal(p, q), ".grad changed by a failed step"
    assert a["history"] == b["history"], "the accountant counted a failed step"
    assert a["samples"] == b["samples"]
    for s, t in zip(a["sums"], b["sums"]):
        assert (s is None and t is None) or all(torch.equal(u, v) for u, v in zip(s, t)), \
            "accumulated sums changed"
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys(), "optimizer state changed by a failed step"
    for k in sa:
        for name in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name])), name


def _warm(model, engine, opt, x, y):
    """One good step and one good virtual step, so that every kind of state is non-trivial."""
    opt.step(loss=_loss(model, x, y))
    opt.virtual_step(loss=_loss(model, x, y))


# -- loss that is not one value per sample ---------------------------------------------------------
BAD_LOSSES = {
    "sum": lambda l, logits, y: l.sum(),
    "mean_reduced": lambda l, logits, y: F.cross_entropy(logits, y),  # reduction="mean"
    "column": lambda l, logits, y: l.unsqueeze(1),  # (B, 1)
    "too_short": lambda l, logits, y: l[:-1],
    "too_long": lambda l, logits, y: torch.cat([l, l]),
    "per_element": lambda l, logits, y: F.mse_loss(logits, torch.zeros_like(logits),
                                                   reduction="none").flatten(),
}


@pytest.mark.parametrize("entry", ["step", "virtual_step", "clipped_grad_sum"])
@pytest.mark.parametrize("kind", list(BAD_LOSSES))
def test_loss_not_one_value_per_sample(kind, entry):
    model, engine, opt, x, y = _setup()
    _warm(model, engine, opt, x, y)
    before = _snapshot(model, opt, engine)
    logits = model(x)
    loss = BAD_LOSSES[kind](F.cross_entropy(logits, y, reduction="none"), logits, y)
    call = {"step": lambda: opt.step(loss=loss),
            "virtual_step": lambda: opt.virtual_step(loss=loss),
            "clipped_grad_sum": lambda: engine.clipped_grad_sum(loss)}[entry]
    with pytest.raises(ValueError) as err:
        call()
    assert REDUCTION in str(err.value), str(err.value)
    _assert_same(before, _snapshot(model, opt, engine))
    # the engine still works afterwards, and the failed call left nothing behind in the records
    opt.step(loss=_loss(model, x, y))
    assert len(engine.accountant.history) == 1 and engine.steps_taken == 2


def test_loss_without_grad():
    model, engine, opt, x, y = _setup()
    with torch.no_grad():
        loss = _loss(model, x, y)
    with pytest.raises(ValueError, match="grad"):
        opt.step(loss=loss)
    with pytest.raises(TypeError):
        opt.step(loss=[1.0, 2.0])


# -- BatchNorm -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bn", [nn.BatchNorm1d(4), nn.BatchNorm2d(4), nn.BatchNorm3d(4),
                                nn.SyncBatchNorm(4)],
                         ids=["1d", "2d", "3d", "sync"])
def test_batchnorm_points_to_fix(bn):
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(bn), nn.Linear(4, 2))
    bn.requires_grad_(False)  # even frozen: batch statistics still mix samples
    with pytest.raises(ValueError) as err:
        make_engine(model, 4)
    msg = str(err.value)
    assert "fix_batchnorm" in msg and "GroupNorm" in msg and "1.0" in msg, msg
    assert not any(m._forward_hooks for m in model.modules())
    if not isinstance(bn, nn.SyncBatchNorm):
        fixed = pe.fix_batchnorm(model.double())
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fixed.modules())
        gn = fixed[1][0]
        assert isinstance(gn, nn.GroupNorm) and gn.weight.dtype == torch.float64
        assert not gn.weight.requires_grad, "a frozen BatchNorm becomes a frozen GroupNorm"
        make_engine(fixed, 4)


# -- step()/virtual_step() misuse ------------------------------------------------------------------
def test_step_without_loss():
    model, engine, opt, x, y = _setup()
    _warm(model, engine, opt, x, y)
    before = _snapshot(model, opt, engine)
    with pytest.raises(ValueError, match="loss="):
        opt.step()
    with pytest.raises(ValueError, match="loss="):
        opt.virtual_step()
    with pytest.raises(ValueError, match="closure"):
        opt.step(closure=lambda: _loss(model, x, y).sum())
    _assert_same(before, _snapshot(model, opt, engine))


def test_virtual_step_after_detach():
    model, engine, opt, x, y = _setup(torch.optim.SGD)
    opt.virtual_step(loss=_loss(model, x, y))
    engine.detach()
    with pytest.raises(RuntimeError, match="attach"):
        opt.virtual_step(loss=_loss(model, x, y))
    assert not any(m._forward_hooks for m in model.modules())
    # the optimizer's own step is back: an ordinary, non-private step works
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, x, y).mean().backward()
    opt.step()
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert engine.steps_taken == 0


def test_attach_checks():
    model, engine, opt, x, y = _setup()
    with pytest.raises(RuntimeError, match="already attached"):
        engine.attach(opt)
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="does not clip"):
        engine.attach(torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1))
    with pytest.raises(TypeError):
        engine.attach(object())


# -- non-finite losses -----------------------------------------------------------------------------
def _poisoned(model, x, y, where):
    xb = x.clone()
    if where == "input_nan":
        xb[1, 0] = float("nan")
    if where == "input_huge":
        xb[1] = 1e300
    loss = _loss(model, xb, y)
    if where == "loss_nan":
        loss = loss * torch.tensor([1.0, float("nan"), 1.0, 1.0], dtype=loss.dtype)
    if where == "loss_inf":
        loss = loss + torch.tensor([0.0, float("inf"), 0.0, 0.0], dtype=loss.dtype)
    return loss


@pytest.mark.parametrize("where", ["loss_nan", "loss_inf", "input_nan", "input_huge"])
@pytest.mark.parametrize("mode", ["bk_mixed", "mixed"])
def test_non_finite_sample_is_dropped_not_a_failed_step(where, mode):
    """A sample whose loss or gradient norm is not finite gets C_i = 0 (its rows zeroed): the step
    goes on and equals the step without that sample — one crafted sample can neither block training
    nor poison it."""
    results = []
    for poisoned in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3)).double()
        engine = make_engine(model, 4, R=0.5, mode=mode)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.attach(opt)
        gen = gen_for(0)
        x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (4,), generator=gen)
        if poisoned:
            opt.step(loss=_poisoned(model, x, y, where))
            assert engine.dropped_samples == 1 and engine.last_norms[1] == 0
        else:
            keep = torch.tensor([0, 2, 3])
            opt.step(loss=_loss(model, x[keep], y[keep]))
        assert engine.steps_taken == 1
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_batch_of_only_non_finite_samples_releases_nothing_but_noise(caplog):
    """Told in a DEBUG record (whether a sample was dropped is a membership signal)."""
    model, engine, opt, x, y = _setup(torch.optim.SGD)
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.DEBUG, logger="private_engine.clipping.batch"):
        opt.step(loss=_loss(model, x, y) * float("nan"))
    assert any("diverged" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)
    assert engine.dropped_samples == 4 and engine.steps_taken == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)  # noise 0: nothing released


def test_failed_virtual_step_does_not_pollute_the_logical_batch():
    """good virtual_step, bad virtual_steps (all samples dropped; a malformed loss raises), good
    step == good virtual_step + good step."""
    results = []
    for include_bad in (False, True):
        model, engine, opt, x, y = _setup(torch.optim.SGD)
        opt.virtual_step(loss=_loss(model, x, y))
        if include_bad:
            opt.virtual_step(loss=_loss(model, x, y) * float("nan"))
            assert engine.dropped_samples == len(x)
            with pytest.raises(ValueError):
                opt.virtual_step(loss=_loss(model, x, y).mean())
        opt.step(loss=_loss(model, x[:2], y[:2]))
        results.append([p.detach().clone() for p in model.parameters()])
        assert engine.steps_taken == 1
    for a, b in zip(*results):
        assert torch.equal(a, b)


# -- custom clip functions that would break the sensitivity ----------------------------------------
BAD_CLIPS = {
    "no_clipping": lambda norms, R: torch.ones_like(norms),
    "twice_R": lambda norms, R: 2 * R / (norms + 1e-6),
    "negative": lambda norms, R: -torch.clamp(R / (norms + 1e-6), max=1.0),
    "wrong_shape": lambda norms, R: torch.ones(len(norms) + 1, dtype=norms.dtype),
    "not_a_tensor": lambda norms, R: 1.0,
}


@pytest.mark.parametrize("kind", list(BAD_CLIPS))
def test_custom_clip_violating_sensitivity(kind):
    model, engine, opt, x, y = _setup(torch.optim.SGD, clip=BAD_CLIPS[kind])
    before = _snapshot(model, opt, engine)
    with pytest.raises(ValueError, match="clipping_fn"):
        opt.step(loss=_loss(model, x, y) * 100)  # norms far above R = 0.5
    _assert_same(before, _snapshot(model, opt, engine))


def test_custom_clip_valid_passes():
    model, engine, opt, x, y = _setup(torch.optim.SGD, clip=tanh_clip)
    opt.step(loss=_loss(model, x, y) * 100)
    assert engine.steps_taken == 1


# -- constructor arguments -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(noise_multiplier=1.0, target_epsilon=1.0, epochs=1), ValueError, "exactly one"),
    (dict(), ValueError, "exactly one"),
    (dict(noise_multiplier=-1.0), ValueError, "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), ValueError, "noise_multiplier"),
    (dict(noise_multiplier=1.0, clipping_mode="fast"), ValueError, "clipping_mode"),
    (dict(noise_multiplier=1.0, clipping_fn="clamp"), ValueError, "clipping_fn"),
    (dict(noise_multiplier=1.0, accountant="moments"), ValueError, "accountant"),
    (dict(noise_multiplier=1.0, max_grad_norm=0.0), ValueError, "max_grad_norm"),
    (dict(noise_multiplier=1.0, batch_size=0), ValueError, "batch_size"),
    (dict(noise_multiplier=1.0, sample_size=3), ValueError, "sample_size"),
    (dict(target_epsilon=1.0), ValueError, "epochs"),
    (dict(target_epsilon=-1.0, epochs=1), ValueError, "target_epsilon"),
])
def test_constructor_arguments(kwargs, exc, match):
    model = nn.Linear(3, 2)
    args = dict(batch_size=4, sample_size=100, max_grad_norm=1.0)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        pe.PrivacyEngine(model, **args)
    assert not model._forward_hooks


def test_model_without_trainable_parameters():
    model = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        make_engine(model, 4)


# -- per-sample gradients the norms would miss -----------------------------------------------------
class TiedOutput(nn.Module):
    """A language-model style tied output projection: emb.weight also used outside emb's forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        return F.linear(h, self.emb.weight)


def _tied_loss(model, ids, y):
    return F.cross_entropy(model(ids).transpose(1, 2), y, reduction="none").sum(1)


def test_weight_used_outside_its_module_is_refused():
    """Its per-sample norm would miss the F.linear use (norms too small: sensitivity above R)."""
    torch.manual_seed(0)
    model = TiedOutput().double()
    engine = make_engine(model, 3, R=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    ids, y = torch.randint(0, 7, (3, 5)), torch.randint(0, 7, (3, 5))
    before = _snapshot(model, opt, engine)
    with pytest.raises(ValueError, match="emb.weight"):
        opt.step(loss=_tied_loss(model, ids, y))
    _assert_same(before, _snapshot(model, opt, engine))
    # frozen, the tied weight is no longer clipped, and the rest is exact
    model.emb.weight.requires_grad_(False)
    from engine_checks import check_against_reference
    engine.detach()
    check_against_reference(model, [ids, y], _tied_loss, mode="mixed", clip="abadi")


def test_loss_from_a_forward_before_the_engine_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    loss = model(x).pow(2).sum(1) * 100  # no hooks yet: nothing recorded
    engine = make_engine(model, 4, R=1.0)
    with pytest.raises(ValueError, match="before the engine was built"):
        engine.clipped_grad_sum(loss)


def test_two_forwards_then_two_steps_is_refused():
    """loss2's forward ran before virtual_step(loss1), whose clipping pass dropped loss2's records;
    without the check loss2's norms were 0 and its gradients went in unclipped."""
    model, engine, opt, x, y = _setup(torch.optim.SGD)
    loss1 = _loss(model, x, y)
    loss2 = _loss(model, x * 2, y)
    opt.virtual_step(loss=loss1)
    before = _snapshot(model, opt, engine)
    with pytest.raises(ValueError, match="batch by batch"):
        opt.step(loss=loss2)
    _assert_same(before, _snapshot(model, opt, engine))
    opt.step(loss=_loss(model, x * 2, y))  # forward and step batch by batch works
    assert engine.steps_taken == 1


def test_detach_then_attach_again():
    """virtual_step after detach says "call engine.attach(optimizer) again": that must clip
    again."""
    from engine_checks import RTOL
    from reference import assert_close_rel, reference_clipped_sum

    model, engine, opt, x, y = _setup(torch.optim.SGD)
    opt.step(loss=_loss(model, x, y))
    engine.detach()
    assert not any(m._forward_hooks for m in model.modules())
    engine.attach(opt)
    ref_sum, _ = reference_clipped_sum(model, [x, y], _loss, 0.5,
                                       lambda n, R: torch.clamp(R / (n + 1e-6), max=1.0))
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(loss=_loss(model, x, y))
    delta = [p.detach() - b for p, b in zip(model.parameters(), before)]
    assert_close_rel(delta, [-0.1 * r / 4 for r in ref_sum], RTOL)
    assert engine.steps_taken == 2
    # a second engine on the same model and optimizer after detaching the first
    engine.detach()
    engine2 = make_engine(model, 4, R=0.5)
    engine2.attach(opt)
    opt.step(loss=_loss(model, x, y))
    assert engine2.steps_taken == 1 and engine.steps_taken == 2


def test_private_step_after_detach_raises_clear_error_and_plain_step_still_works():
    import torch
    from torch import nn

    import private_engine as pe

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    engine.detach()
    loss = model(torch.randn(4, 3)).sum(1)
    with pytest.raises(RuntimeError, match="detached"):
        opt.step(loss=loss)
    before = model.weight.detach().clone()
    loss.sum().backward()
    opt.step()  # the optimizer's own step is back
    assert not torch.equal(before, model.weight)


def test_all_dropped_is_a_debug_record_in_both_steps_and_no_warning(caplog):
    model = nn.Linear(3, 2)
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=0.0)
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    x = torch.full((4, 3), float("nan"))
    with warnings.catch_warnings(record=True) as caught, \
            caplog.at_level(logging.DEBUG, logger="private_engine.clipping.batch"):
        warnings.simplefilter("always")
        opt.virtual_step(loss=model(x).sum(1))
        opt.step(loss=model(x).sum(1))
    assert not [w for w in caught if "non-finite" in str(w.message)]
    told = [r for r in caplog.records if "every sample of this batch" in r.getMessage()]
    assert [r.levelno for r in told] == [logging.DEBUG, logging.DEBUG]
