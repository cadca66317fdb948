"""The sampling that actually happened: Poisson batches are accounted; fixed-size batches (a
shuffled ``DataLoader(batch_size=B)``) are refused, at construction when the engine sees the loader
and otherwise once their sizes contradict Poisson sampling; a data set of another size than
``sample_size`` is refused."""
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from private_engine import accounting
from private_engine.accounting import SamplingRateCheck, SamplingRateError
from private_engine.data import poisson_loader

pytestmark = pytest.mark.usefixtures("one_thread")

N, B = 200, 10


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _engine(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=1.0,
                              noise_multiplier=1.0, **kwargs)
    return engine, engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))


def _step(engine, opt, x, y):
    opt.step(loss=F.cross_entropy(engine.model(x), y, reduction="none"))


def test_a_shuffled_fixed_size_loader_is_refused_before_its_release():
    """Batches of exactly B from ``DataLoader(shuffle=True)``: under Poisson sampling at q = B/n
    a batch holds exactly B with probability 0.128, so 13 such batches in a row are refused (the
    13th, before its noise), naming poisson_loader; nothing of the refused step is applied."""
    engine, opt = _engine()
    loader = DataLoader(_data(), batch_size=B, shuffle=True)
    steps = 0
    with pytest.raises(SamplingRateError, match=r"fixed-size batches.*poisson_loader"):
        for _ in range(2):
            for x, y in loader:
                before = [p.detach().clone() for p in engine.model.parameters()]
                _step(engine, opt, x, y)
                steps += 1
    assert steps == engine.steps_taken == 12
    assert all(torch.equal(a, p) for a, p in zip(before, engine.model.parameters()))
    assert engine.sampling_check.steps == 12
    # the same data through poisson_loader is accounted
    engine, opt = _engine()
    loader = poisson_loader(_data(), B, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for x, y in loader:
            _step(engine, opt, x, y)
    assert engine.steps_taken == 3 * len(loader) == 60
    assert 0 < engine.get_epsilon() < math.inf


def test_an_engine_given_the_loader_refuses_fixed_size_batches_and_a_wrong_sample_size():
    with pytest.raises(SamplingRateError, match=r"fixed-size batches.*poisson_loader"):
        _engine(data_loader=DataLoader(_data(), batch_size=B, shuffle=True))
    with pytest.raises(ValueError, match=r"sample_size=200 but the data loader's data set "
                                         r"holds 150 examples"):
        _engine(data_loader=poisson_loader(TensorDataset(torch.zeros(150, 4)), B))
    with pytest.raises(ValueError, match=r"samples at rate 0\.1, .* q = .* 0\.05"):
        _engine(data_loader=poisson_loader(_data(), 2 * B))
    engine, _ = _engine(data_loader=poisson_loader(_data(), B))
    assert engine.sample_size == N


def test_check_loader_takes_a_dataset_of_the_declared_size_only():
    loader = poisson_loader(_data(), B)
    accounting.check_loader(loader, B, N)
    with pytest.raises(ValueError, match="sample_size=201"):
        accounting.check_loader(loader, B, 201)
    # with check_sampling=False the loader's size is still checked
    with pytest.raises(ValueError, match="sample_size=201"):
        accounting.check_loader(DataLoader(_data(), batch_size=B), B, 201, poisson=False)
    accounting.check_loader(DataLoader(_data(), batch_size=B), B, N, poisson=False)


def test_fixed_size_counts_are_refused_after_the_documented_number_of_steps():
    """All batches of B: refused at step ⌈log 1e-11 / log p₀⌉; shuffled epochs with a last, smaller
    batch are refused too; q = 1 (full batches under either sampling) never, nor Poisson
    sizes."""
    for n, b in [(200, 10), (50_000, 256), (100, 1), (64, 8)]:
        check = SamplingRateCheck(b, n)
        k = math.ceil(math.log(1e-11) / math.log(check.exact_probability))
        for _ in range(k - 1):
            check.check(b)
            check.commit(b)
        with pytest.raises(SamplingRateError, match="fixed-size"):
            check.check(b)
    check = SamplingRateCheck(64, 1000)  # epochs of 15 batches of 64 and one of 40
    with pytest.raises(SamplingRateError, match="fixed-size"):
        for size in ([64] * 15 + [40]) * 10:
            check.check(size)
            check.commit(size)
    check = SamplingRateCheck(50, 50)
    for _ in range(1000):
        check.check(50)
        check.commit(50)
    # Binomial(n, q) batch sizes never raise it, small B included (batches of B are common)
    rng = np.random.default_rng(1)
    for n, b in [(100, 1), (20, 2), (1_000, 10), (64, 60)]:
        check = SamplingRateCheck(b, n)
        for size in rng.binomial(n, b / n, size=20_000):
            check.check(int(size))
            check.commit(int(size))


def test_check_sampling_false_steps_fixed_batches_knowingly():
    with pytest.warns(UserWarning, match="check_sampling=False.*not a privacy guarantee"):
        engine, opt = _engine(check_sampling=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in DataLoader(_data(), batch_size=B, shuffle=True):
            _step(engine, opt, x, y)
    assert engine.steps_taken == 20
    report = engine.privacy_report()
    assert not report.sampling_checked and "sampling not checked" in str(report)
