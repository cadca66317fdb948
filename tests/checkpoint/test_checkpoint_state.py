"""engine.state_dict() / load_state_dict() and the checkpoint file, in one process: public values
only (no accumulation in progress, no data-dependent counter, the generator's state only when the
user gave it), other privacy parameters refused, a run with a given generator resumed bit for bit,
the file written atomically and read with weights_only=True."""
import io
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from private_engine.checkpoint import engine_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")




def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _setup(mode="bk_mixed", *, noise_seed=5, optimizer="adam", **kwargs):
    model = _model()
    opt = (torch.optim.Adam(model.parameters(), lr=0.1) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    params = dict(batch_size=8, sample_size=64, max_grad_norm=0.5, noise_multiplier=1.2,
                  clipping_mode=mode)
    params.update(kwargs)
    if not params.get("secure_mode"):
        params["noise_generator"] = torch.Generator().manual_seed(noise_seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, **params)
    engine.attach(opt)
    return model, opt, engine


def _batches(n, size=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 5, generator=gen), torch.randint(0, 3, (size,), generator=gen))
            for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _roundtrip(obj):
    """torch.save then torch.load(weights_only=True): what a checkpoint file gives back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _snapshot(model, opt, engine):
    return _roundtrip({"model": model.state_dict(), "opt": opt.state_dict(),
                       "engine": engine.state_dict()})


def _restore(snapshot, model, opt, engine):
    model.load_state_dict(snapshot["model"])
    opt.load_state_dict(snapshot["opt"])
    engine.load_state_dict(snapshot["engine"])


@pytest.mark.parametrize("mode", ["bk_mixed", "bk", "ghost", "per_sample"])
def test_no_state_in_the_middle_of_a_logical_batch(mode, tmp_path):
    """After a virtual_step the accumulation holds clipped sums not yet noised: engine.state_dict()
    and save_checkpoint refuse (nothing written), and both work again after optimizer.step()."""
    model, opt, engine = _setup(mode)
    opt.step(loss=_loss(model, _batches(1)[0]))
    opt.virtual_step(loss=_loss(model, _batches(1, seed=2)[0]))
    with pytest.raises(ValueError, match=r"right after optimizer\.step\(\)"):
        engine.state_dict()
    with pytest.raises(ValueError, match="accumulated"):
        pe.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)
    assert os.listdir(tmp_path) == []
    opt.step(loss=_loss(model, _batches(1, seed=3)[0]))
    assert engine.state_dict()["accountant"]["history"] == [(1.2, 8 / 64, 2)]
    pe.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)


@pytest.mark.parametrize("mode", ["bk_mixed", "per_sample"])
def test_given_generator_resumes_bit_for_bit(mode):
    """With a noise_generator the user gave (a reproducible run), its state is kept: a fresh
    engine loading the state after two steps continues as the run that never stopped."""
    batches = _batches(6)
    model, opt, engine = _setup(mode)
    for b in batches[:2]:
        opt.step(loss=_loss(model, b))
    snapshot = _snapshot(model, opt, engine)
    model2, opt2, engine2 = _setup(mode, noise_seed=999)  # another seed: its state is loaded
    _restore(snapshot, model2, opt2, engine2)
    for m, o in ((model, opt), (model2, opt2)):
        o.virtual_step(loss=_loss(m, batches[2]))
        o.step(loss=_loss(m, batches[3]))
        o.step(loss=_loss(m, batches[4]))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert engine.get_epsilon() == engine2.get_epsilon() > 0
    assert engine.steps_taken == engine2.steps_taken == 4


def test_state_dict_holds_public_values_only():
    """The privacy parameters, the accountant's history and the given generator's state; no
    accumulation, no sampling-rate totals, no dropped-sample count (functions of the data)."""
    model, opt, engine = _setup()
    opt.step(loss=_loss(model, _batches(1)[0]))
    state = engine.state_dict()
    back = _roundtrip(state)  # weights_only=True reads it
    assert back["accountant"] == {"name": "rdp", "history": [(1.2, 8 / 64, 1)]}
    assert torch.equal(back["noise_generator"], engine.noise_generator.get_state())  # given
    assert back["privacy"]["noise_multiplier"] == 1.2 and back["privacy"]["max_grad_norm"] == 0.5
    assert back["loss_scaling"] is None and back["ledger"] is None
    assert set(back) == {"format", "version", "privacy", "accountant", "ledger",
                         "noise_generator", "noise_generator_device", "loss_scaling",
                         "clipping_mode"}


@pytest.mark.parametrize("change, name", [
    ({"noise_multiplier": 1.0}, "noise_multiplier"),
    ({"max_grad_norm": 0.25}, "max_grad_norm"),
    ({"batch_size": 16}, "batch_size"),
    ({"sample_size": 128}, "sample_size"),
    ({"target_delta": 1e-3}, "target_delta"),
    ({"accountant": "prv"}, "accountant"),
])
def test_other_privacy_parameters_are_refused(change, name):
    model, opt, engine = _setup()
    opt.step(loss=_loss(model, _batches(1)[0]))
    state = _roundtrip(engine.state_dict())
    model2, opt2, other = _setup(**change)
    before = other.noise_generator.get_state()
    with pytest.raises(ValueError, match=name):
        other.load_state_dict(state)
    assert other.accountant.history == [] and other._attached[0].grad_sums is None
    assert torch.equal(other.noise_generator.get_state(), before)


@pytest.mark.parametrize("fields", [("target_epsilon", "steps"), ("accountant",)])
def test_a_state_without_the_budgets_fields_is_refused_not_loaded_with_a_fresh_budget(fields):
    """A state that does not record the budget (an older or foreign writer) would read as "no
    target, no planned length" and load into an engine built without them: a fresh budget guard
    over steps already spent. It is refused, naming what is missing, with nothing changed."""
    model, opt, engine = _setup(steps=20)
    opt.step(loss=_loss(model, _batches(1)[0]))
    state = _roundtrip(engine.state_dict())
    for field in fields:
        del state["privacy"][field]
    _, _, fresh = _setup()
    with pytest.raises(ValueError, match=r"missing: \[" + repr(fields[0]) + r".*older"):
        fresh.load_state_dict(state)
    assert fresh.accountant.history == [] and fresh.budget.epsilon_budget is None


def test_a_changed_max_grad_norm_loads_once_set_to_the_checkpoints():
    model, opt, engine = _setup()
    opt.step(loss=_loss(model, _batches(1)[0]))
    engine.max_grad_norm = 0.75  # changed during training
    state = engine.state_dict()
    _, _, fresh = _setup()
    with pytest.raises(ValueError, match="max_grad_norm.*engine.max_grad_norm"):
        fresh.load_state_dict(state)
    fresh.max_grad_norm = 0.75
    fresh.load_state_dict(state)
    assert fresh.accountant.history == engine.accountant.history


def test_secure_mode_state_has_no_generator_and_is_refused_by_a_seeded_engine():
    model, opt, engine = _setup(secure_mode=True)
    opt.step(loss=_loss(model, _batches(1)[0]))
    state = _roundtrip(engine.state_dict())
    assert state["noise_generator"] is None and state["privacy"]["secure_mode"] is True
    _, _, seeded = _setup()
    with pytest.raises(ValueError, match="secure_mode"):
        seeded.load_state_dict(state)
    _, _, secure = _setup(secure_mode=True)
    secure.load_state_dict(state)
    assert secure.steps_taken == 1


@pytest.mark.parametrize("accountant", ["rdp", "prv", "gdp", "pld"])
def test_every_accountant_resumes_to_the_same_epsilon(accountant):
    model, opt, engine = _setup(accountant=accountant)
    for b in _batches(3):
        opt.step(loss=_loss(model, b))
    _, _, fresh = _setup(accountant=accountant)
    fresh.load_state_dict(_roundtrip(engine.state_dict()))
    assert fresh.get_epsilon() == engine.get_epsilon() > 0
    assert fresh.accountant.history == engine.accountant.history


@pytest.mark.parametrize("dynamic", [False, True])
def test_loss_scaling_keeps_the_fixed_scale_and_no_counter(dynamic):
    """A fixed scale is the user's choice (public) and comes back; a dynamic scale moved with
    which private samples overflowed, so it is not written (the resumed run starts from the
    scaler it was built with); the overflow counters are never written."""
    def build(scaler):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = pe.PrivacyEngine(model, batch_size=8, sample_size=64, max_grad_norm=0.5,
                                      noise_multiplier=1.0, grad_scaler=scaler,
                                      dynamic_loss_scale=dynamic,
                                      noise_generator=torch.Generator().manual_seed(0))
        engine.attach(opt)
        return model, opt, engine

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    model, opt, engine = build(scaler)
    engine.clipped_grad_sum(_loss(model, _batches(1)[0]))  # one good batch of three
    engine.loss_scaling.overflow_batches, engine.loss_scaling.dropped_samples = 2, 5
    state = _roundtrip(engine.state_dict())
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 3, growth_interval=3)
    _, _, engine2 = build(scaler2)
    engine2.load_state_dict(state)
    if dynamic:
        assert state["loss_scaling"] is None
        assert scaler2.get_scale() == 2.0 ** 3
    else:
        assert scaler2.state_dict() == scaler.state_dict()
    ls = engine2.loss_scaling
    assert (ls._good_batches, ls.overflow_batches, ls.dropped_samples) == (0, 0, 0)
    _, _, plain = _setup()
    with pytest.raises(ValueError, match="grad_scaler"):
        plain.load_state_dict(state)


# -- the file ------------------------------------------------------------------------------------
def test_checkpoint_file_roundtrip(tmp_path):
    model, opt, engine = _setup()
    opt.step(loss=_loss(model, _batches(1)[0]))
    path = tmp_path / "ckpt.pt"
    pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine,
                       extra={"epoch": 3, "loader": torch.Generator().manual_seed(1).get_state()})
    if os.name == "posix":
        assert (path.stat().st_mode & 0o777) == 0o600  # as secret as the data
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.ledger"]
    model2, opt2, engine2 = _setup(noise_seed=77)
    extra = pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    assert extra["epoch"] == 3
    for m, o in ((model, opt), (model2, opt2)):
        o.step(loss=_loss(m, _batches(1, seed=3)[0]))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    assert engine.get_epsilon() == engine2.get_epsilon()


def test_checkpoint_needs_the_attached_optimizer(tmp_path):
    model, opt, engine = _setup()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not attached"):
        pe.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=other, engine=engine)
    pe.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)
    with pytest.raises(ValueError, match="not attached"):
        pe.load_checkpoint(tmp_path / "c.pt", model=model, optimizer=other, engine=engine)
    with pytest.raises(ValueError, match="not the engine's"):
        pe.save_checkpoint(tmp_path / "c.pt", model=_model(), optimizer=opt, engine=engine)


def test_other_privacy_parameters_in_a_file_change_nothing(tmp_path):
    model, opt, engine = _setup()
    opt.step(loss=_loss(model, _batches(1)[0]))
    pe.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)
    model2, opt2, engine2 = _setup(noise_multiplier=2.0)
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match="noise_multiplier: checkpoint 1.2, engine 2.0"):
        pe.load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2, engine=engine2)
    assert all(torch.equal(p, q) for p, q in zip(before, model2.parameters()))
    assert opt2.state_dict()["state"] == {}


def test_a_failed_write_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    """torch.save raising halfway through the file (a crash mid-write): the previous checkpoint
    is untouched, byte for byte, still loads, and no temporary file is left behind."""
    model, opt, engine = _setup()
    path = tmp_path / "ckpt.pt"
    pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine, extra={"n": 1})
    old_bytes = path.read_bytes()
    opt.step(loss=_loss(model, _batches(1)[0]))

    real_save = torch.save

    def half_then_fail(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="simulated"):
        pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine, extra={"n": 2})
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.ledger"]
    model2, opt2, engine2 = _setup()
    assert pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2) == {"n": 1}
    assert engine2.steps_taken == 1  # the step released after the checkpoint counts


def test_engine_state_dict_function_is_the_method():
    model, opt, engine = _setup()
    a, b = engine_state_dict(engine), engine.state_dict()
    assert a.keys() == b.keys() and a["privacy"] == b["privacy"]
