"""The step ledger (private_engine.accounting.ledger) and how checkpoints use it: each step is on
disk before its update; a resumed run counts the steps recorded after its checkpoint; a missing,
foreign or short ledger and a checkpoint of the older format are refused unless ``ledger=False``
says that nothing was released after the checkpoint."""
import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from private_engine.accounting.ledger import StepLedger, is_prefix, merge_history, read_ledger
from private_engine.checkpoint import CHECKPOINT_FORMAT, ENGINE_FORMAT, use_ledger

pytestmark = pytest.mark.usefixtures("one_thread")

SIGMA, Q = 1.2, 8 / 64




def _setup(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = pe.PrivacyEngine(model, batch_size=8, sample_size=64, max_grad_norm=0.5,
                              noise_multiplier=SIGMA, **kwargs)
    engine.attach(opt)
    return model, opt, engine


def _step(model, opt, seed=0, size=8):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(size, 5, generator=gen), torch.randint(0, 3, (size,), generator=gen)
    opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))


def _steps(model, opt, n, start=0):
    for k in range(n):
        _step(model, opt, seed=start + k)


# -- the file ------------------------------------------------------------------------------------
def test_history_helpers():
    assert merge_history([(1.0, 0.1, 2)], [(1.0, 0.1, 1), (2.0, 0.1, 1)]) == [
        (1.0, 0.1, 3), (2.0, 0.1, 1)]
    assert is_prefix([], [(1.0, 0.1, 2)])
    assert is_prefix([(1.0, 0.1, 2)], [(1.0, 0.1, 3), (2.0, 0.1, 1)])
    assert is_prefix([(1.0, 0.1, 3), (2.0, 0.1, 1)], [(1.0, 0.1, 3), (2.0, 0.1, 4)])
    assert not is_prefix([(1.0, 0.1, 4)], [(1.0, 0.1, 3), (2.0, 0.1, 1)])
    assert not is_prefix([(1.0, 0.1, 3)], [(1.0, 0.1, 2)])
    assert not is_prefix([(1.0, 0.2, 1)], [(1.0, 0.1, 2)])


def test_ledger_records_public_values_durably(tmp_path):
    path = tmp_path / "run.ledger"
    ledger = StepLedger.create(path, [(SIGMA, Q, 3)])
    ledger.record(SIGMA, Q)
    ledger.record(2.0, Q)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert set(header) == {"format", "version", "run", "history"}
    assert header["history"] == [[SIGMA, Q, 3]]
    assert [json.loads(line) for line in lines[1:]] == [[4, SIGMA, Q], [5, 2.0, Q]]
    contents = read_ledger(path)
    assert contents.run == ledger.run == header["run"]
    assert contents.history == ledger.history == [(SIGMA, Q, 4), (2.0, Q, 1)]
    with pytest.raises(FileExistsError):
        StepLedger.create(path)  # never replaces a run's ledger
    ledger.close()


def test_a_torn_last_line_is_ignored_and_cut_when_reopened(tmp_path):
    """A crash in the middle of a record leaves a line without its newline: its step waited for
    the fsync, so it was not released; reading ignores it, and appending again starts clean."""
    path = tmp_path / "run.ledger"
    StepLedger.create(path).record(SIGMA, Q)
    with open(path, "ab") as f:
        f.write(b"[2, 1.2")
    assert read_ledger(path).steps == 1
    ledger = StepLedger.open(path)
    ledger.record(SIGMA, Q)
    assert read_ledger(path).steps == 2
    assert path.read_bytes().endswith(b"\n[2, 1.2, 0.125]\n")
    with open(path, "ab") as f:
        f.write(b"garbage\n")
    with pytest.raises(ValueError, match="damaged"):
        read_ledger(path)


# -- the engine's ledger ---------------------------------------------------------------------------
def test_each_step_is_on_disk_before_its_update(tmp_path):
    """The wrapped optimizer's own step (which writes the update) finds the step's line already
    in the file."""
    model, opt, engine = _setup()
    path = tmp_path / "ckpt.pt"
    pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine)
    seen = []

    def before_update(optimizer, args, kwargs):
        seen.append((read_ledger(str(path) + ".ledger").steps, engine.steps_taken))

    opt.register_step_pre_hook(before_update)
    _steps(model, opt, 3)
    assert seen == [(1, 0), (2, 1), (3, 2)]


def test_a_step_that_fails_after_its_record_still_counts(tmp_path):
    """The optimizer's own step raising after the record: the engine does not count the step,
    the ledger does (the update may have been partly applied): a resumed run counts it."""
    model, opt, engine = _setup()
    path = tmp_path / "ckpt.pt"
    pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine)

    def fail(optimizer, args, kwargs):
        raise RuntimeError("the optimizer failed")

    handle = opt.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        _step(model, opt)
    handle.remove()
    assert engine.steps_taken == 0
    model2, opt2, engine2 = _setup()
    pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    assert engine2.steps_taken == 1


def test_older_checkpoints_and_later_ones_share_the_run_ledger(tmp_path):
    """Checkpoints at several paths name the one ledger created by the first: resuming from the
    oldest counts every step the run released."""
    model, opt, engine = _setup()
    for k in range(3):
        _steps(model, opt, 2, start=2 * k)
        pe.save_checkpoint(tmp_path / f"ckpt{k}.pt", model=model, optimizer=opt, engine=engine)
    _steps(model, opt, 1, start=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt0.pt", "ckpt0.pt.ledger", "ckpt1.pt", "ckpt2.pt"]
    model2, opt2, engine2 = _setup()
    pe.load_checkpoint(tmp_path / "ckpt0.pt", model=model2, optimizer=opt2, engine=engine2)
    assert engine2.steps_taken == 7
    assert engine2.get_epsilon() == engine.get_epsilon()
    _steps(model2, opt2, 1)  # the resumed run records in the same ledger
    assert read_ledger(tmp_path / "ckpt0.pt.ledger").steps == 8


def test_a_moved_checkpoint_finds_its_ledger_beside_it(tmp_path):
    model, opt, engine = _setup()
    _steps(model, opt, 2)
    pe.save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, engine=engine)
    _steps(model, opt, 1, start=5)
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("ckpt.pt", "ckpt.pt.ledger"):
        os.replace(tmp_path / name, moved / name)
    model2, opt2, engine2 = _setup()
    pe.load_checkpoint(moved / "ckpt.pt", model=model2, optimizer=opt2, engine=engine2)
    assert engine2.steps_taken == 3
    assert engine2.ledger.path == str(moved / "ckpt.pt.ledger")


def test_a_missing_ledger_is_refused_unless_told_nothing_was_released(tmp_path):
    model, opt, engine = _setup()
    _steps(model, opt, 2)
    path = tmp_path / "ckpt.pt"
    pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine)
    _steps(model, opt, 2, start=2)
    os.replace(str(path) + ".ledger", tmp_path / "elsewhere.ledger")
    model2, opt2, engine2 = _setup()
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match="ledger of this checkpoint is missing"):
        pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    assert engine2.steps_taken == 0
    assert all(torch.equal(p, q) for p, q in zip(before, model2.parameters()))
    pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2,
                       ledger=tmp_path / "elsewhere.ledger")
    assert engine2.steps_taken == 4
    model3, opt3, engine3 = _setup()
    pe.load_checkpoint(path, model=model3, optimizer=opt3, engine=engine3, ledger=False)
    assert engine3.steps_taken == 2


def test_a_foreign_or_short_ledger_is_refused(tmp_path):
    model, opt, engine = _setup()
    _steps(model, opt, 3)
    path = tmp_path / "ckpt.pt"
    pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine)
    mine = str(path) + ".ledger"
    header = json.loads(open(mine).readline())
    model2, opt2, engine2 = _setup()
    StepLedger.create(tmp_path / "other.ledger", [(SIGMA, Q, 5)]).close()
    with pytest.raises(ValueError, match="another run"):
        pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2,
                           ledger=tmp_path / "other.ledger")
    header["history"] = [[SIGMA, Q, 1]]  # the run's ledger, cut short
    with open(mine, "w") as f:
        f.write(json.dumps(header) + "\n")
    with pytest.raises(ValueError, match="do not extend the checkpoint's 3"):
        pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    assert engine2.steps_taken == 0


def test_save_refuses_to_take_over_another_runs_ledger(tmp_path):
    model, opt, engine = _setup()
    _steps(model, opt, 1)
    path = tmp_path / "ckpt.pt"
    pe.save_checkpoint(path, model=model, optimizer=opt, engine=engine)
    model2, opt2, engine2 = _setup()  # a new run, saving to the same path
    with pytest.raises(ValueError, match="step ledger of another run"):
        pe.save_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)


def test_use_ledger_counts_a_run_killed_before_its_first_checkpoint(tmp_path):
    """A ledger opened before the first step: a run killed before any checkpoint, restarted from
    scratch with the same ledger, counts the steps the first run released."""
    path = tmp_path / "run.ledger"
    model, opt, engine = _setup()
    assert use_ledger(engine, path) is engine.ledger
    _steps(model, opt, 4)
    model2, opt2, engine2 = _setup()
    use_ledger(engine2, path)
    assert engine2.steps_taken == 4 and engine2.get_epsilon() == engine.get_epsilon()
    _steps(model2, opt2, 1)
    pe.save_checkpoint(tmp_path / "ckpt.pt", model=model2, optimizer=opt2, engine=engine2)
    assert not (tmp_path / "ckpt.pt.ledger").exists()  # the checkpoint names run.ledger
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["engine"]["ledger"]["path"] == str(
        path)
    model3, opt3, engine3 = _setup()
    _steps(model3, opt3, 6)  # more steps than the ledger records: another run
    with pytest.raises(ValueError, match="another run"):
        use_ledger(engine3, path)


# -- the older format ------------------------------------------------------------------------------
def _old_checkpoint(path, model, opt, engine, accumulation=None):
    """A file as the older format (version 1) wrote it: the generator state, an accumulation in
    progress, the counters, no ledger."""
    privacy = engine.state_dict()["privacy"]
    torch.save({
        "format": CHECKPOINT_FORMAT, "version": 1, "model": model.state_dict(),
        "optimizer": opt.state_dict(), "extra": {"epoch": 2},
        "engine": {"format": ENGINE_FORMAT, "version": 1, "privacy": privacy,
                   "accountant": {"name": "rdp", "history": list(engine.accountant.history)},
                   "noise_generator": engine.noise_generator.get_state(),
                   "noise_generator_device": "cpu", "accumulation": [accumulation],
                   "loss_scaling": None, "sampling_check": {"steps": 3, "samples": 25},
                   "dropped_samples": 0, "clipping_mode": "bk_mixed"}}, path)


def test_an_older_checkpoint_loads_its_budget_only_when_told_nothing_was_released(tmp_path):
    """Version 1 kept no ledger: refused with the reason, or loaded with ``ledger=False`` and its
    accountant history (never a reset budget); its generator state is not restored."""
    model, opt, engine = _setup()
    _steps(model, opt, 3)
    path = tmp_path / "old.pt"
    _old_checkpoint(path, model, opt, engine)
    model2, opt2, engine2 = _setup()
    with pytest.raises(ValueError, match="version 1.*ledger=False"):
        pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2)
    assert engine2.steps_taken == 0
    before = engine2.noise_generator.get_state()
    assert pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2,
                              ledger=False) == {"epoch": 2}
    assert engine2.accountant.history == engine.accountant.history
    assert engine2.get_epsilon() == engine.get_epsilon() > 0
    assert torch.equal(engine2.noise_generator.get_state(), before)
    pe.save_checkpoint(tmp_path / "new.pt", model=model2, optimizer=opt2, engine=engine2)
    assert read_ledger(tmp_path / "new.pt.ledger").steps == 3  # the budget carries on


def test_an_older_checkpoint_taken_mid_batch_is_refused(tmp_path):
    model, opt, engine = _setup()
    _steps(model, opt, 1)
    path = tmp_path / "old.pt"
    sums = {"grads": [torch.zeros_like(p) for p in model.parameters()], "samples": 4}
    _old_checkpoint(path, model, opt, engine, accumulation=sums)
    model2, opt2, engine2 = _setup()
    with pytest.raises(ValueError, match="middle of a logical batch"):
        pe.load_checkpoint(path, model=model2, optimizer=opt2, engine=engine2, ledger=False)
    assert engine2.steps_taken == 0


def test_secure_mode_and_given_generators_keep_their_ledgers(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kwargs in ({"secure_mode": True}, {"noise_generator": torch.Generator()}):
            folder = tmp_path / next(iter(kwargs))
            folder.mkdir()
            model, opt, engine = _setup(**kwargs)
            pe.save_checkpoint(folder / "c.pt", model=model, optimizer=opt, engine=engine)
            _steps(model, opt, 2)
            model2, opt2, engine2 = _setup(**kwargs)
            pe.load_checkpoint(folder / "c.pt", model=model2, optimizer=opt2, engine=engine2)
            assert engine2.steps_taken == 2
