"""Where the heads' noise comes from: the library's one randomness policy
(private_engine.foundation.randomness). By default every head, the probe and the warm-up draw from a
generator whose whole MT19937 state (624 words of 32 bits) comes from OS entropy — not a state
that ``manual_seed`` of a 32-bit value produces, which an attacker who knows the other records
could enumerate; integer seeds count with all their bits; reproducible randomness warns."""
import math
import warnings

import numpy as np
import pytest
import torch

from private_engine.foundation.randomness import MT_N, ReproducibleRandomnessWarning, mt_init
from private_engine.heads import (
    DPAdamHead,
    DPFeatureCovariance,
    DPLeastSquares,
    DPMeanEstimator,
    DPNewton,
)
from private_engine.heads._noise import NoiseSource
from private_engine.heads.probe import probe_sweep
from private_engine.heads.warmup import _dp_generator

CLASSES = [0, 1, 2]  # the public label set of data()
HEADS = {
    "ls": lambda **kw: DPLeastSquares(classes=CLASSES, **kw),
    "newton": lambda **kw: DPNewton(classes=CLASSES, **kw),
    "fc": lambda **kw: DPFeatureCovariance(steps=2, classes=CLASSES, **kw),
    "adam": lambda **kw: DPAdamHead(steps=2, classes=CLASSES, **kw),
    "mean": lambda **kw: DPMeanEstimator(classes=CLASSES, **kw),
}
_WORDS = 24  # byte offset of the 624 uint64 state words in torch's CPU generator state


def data(n=60, d=4, m=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) + 2 * np.eye(m, d)[np.arange(n) % m], np.arange(n) % m


def mt_words(state: torch.Tensor):
    return state[_WORDS:_WORDS + 8 * MT_N].view(torch.int64).tolist()


def from_32_bit_seed(state: torch.Tensor) -> bool:
    """Whether a CPU generator state is what ``manual_seed(s)`` gives for some s < 2**32: the
    first word is s and the others follow MT19937's initialisation recurrence from it."""
    words = mt_words(state)
    return words == mt_init(words[0])


@pytest.fixture
def generator_states(monkeypatch):
    """The state of every generator a head's NoiseSource is built with, before any draw."""
    states = []
    original = NoiseSource.__init__

    def init(self, generator, ledger=None):
        states.append(None if generator is None else generator.get_state().clone())
        original(self, generator, ledger)

    monkeypatch.setattr(NoiseSource, "__init__", init)
    return states


def test_the_check_recognises_32_bit_seeds():
    for seed in (0, 5489, 2**32 - 1):
        assert from_32_bit_seed(torch.Generator().manual_seed(seed).get_state())
    g = torch.Generator()
    g.seed()  # torch keeps 32 bits of its 64-bit random seed on the CPU
    assert from_32_bit_seed(g.get_state())


@pytest.mark.parametrize("head", list(HEADS))
def test_default_noise_has_a_full_entropy_state(head, generator_states):
    X, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReproducibleRandomnessWarning)  # the default is secret
        for _ in range(2):
            HEADS[head](noise_multiplier=1.0).fit(X, y)
    assert len(generator_states) == 2
    for state in generator_states:
        assert not from_32_bit_seed(state)
        assert len(set(mt_words(state))) > MT_N - 5  # 624 (almost surely distinct) random words
    assert mt_words(generator_states[0]) != mt_words(generator_states[1])


def test_a_fit_without_noise_draws_nothing(generator_states):
    X, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReproducibleRandomnessWarning)
        DPLeastSquares(epsilon=math.inf, random_state=3).fit(X, y)  # nothing to reproduce
    assert generator_states == [None]


@pytest.mark.parametrize("head", list(HEADS))
def test_integer_seeds_count_with_all_their_bits(head):
    X, y = data()
    low = 12345

    def fit(seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReproducibleRandomnessWarning)  # checked below
            clf = HEADS[head](noise_multiplier=1.0, random_state=seed).fit(X, y)
        return clf.centers_ if head == "mean" else clf.coef_

    a, b, c = fit(low + 2**32), fit(low), fit(low)
    assert torch.equal(b, c)  # reproducible
    assert not torch.equal(a, b)  # not truncated to the low 32 bits
    assert not torch.equal(fit(low + 2**64), b)


def test_reproducible_randomness_warns_and_names_the_head():
    X, y = data()
    with pytest.warns(ReproducibleRandomnessWarning, match="the noise of DPLeastSquares"):
        DPLeastSquares(noise_multiplier=1.0, classes=CLASSES, random_state=2**40).fit(X, y)
    with pytest.warns(ReproducibleRandomnessWarning, match="the noise of DPNewton"):
        DPNewton(noise_multiplier=1.0, classes=CLASSES,
                 random_state=torch.Generator().manual_seed(1)).fit(X, y)
    with pytest.warns(ReproducibleRandomnessWarning, match="the noise of DPMeanEstimator"):
        DPMeanEstimator(noise_multiplier=1.0, classes=CLASSES,
                        random_state=np.random.default_rng(1)).fit(X, y)
    with pytest.raises(TypeError, match="noise of DPLeastSquares"):
        DPLeastSquares(noise_multiplier=1.0, classes=CLASSES, random_state="seed").fit(X, y)


def test_same_torch_generator_seed_same_model():
    X, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleRandomnessWarning)
        a = DPAdamHead(noise_multiplier=1.0, classes=CLASSES, steps=3,
                       random_state=torch.Generator().manual_seed(7)).fit(X, y).coef_
        b = DPAdamHead(noise_multiplier=1.0, classes=CLASSES, steps=3,
                       random_state=torch.Generator().manual_seed(7)).fit(X, y).coef_
    assert torch.equal(a, b)


def test_probe_draws_secret_noise_by_default(generator_states):
    X, y = data(n=120)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReproducibleRandomnessWarning)
        probe_sweep(X[:90], y[:90], X[90:], y[90:], epsilons=[1.0], seeds=2, progress=False)
    assert len(generator_states) == 2 * 5
    assert not any(from_32_bit_seed(s) for s in generator_states)
    assert len({tuple(mt_words(s)[:4]) for s in generator_states}) == len(generator_states)


def test_probe_noise_seed_is_reproducible():
    X, y = data(n=120)

    def sweep(seed):
        with pytest.warns(ReproducibleRandomnessWarning):
            return probe_sweep(X[:90], y[:90], X[90:], y[90:], methods=["ls", "adam"],
                               epsilons=[0.3], seeds=3, progress=False,
                               noise_seed=seed).accuracies

    assert sweep(2**40 + 1) == sweep(2**40 + 1)


def test_warmup_generators_have_full_states():
    secret = _dp_generator(None, "cpu")
    assert not from_32_bit_seed(secret.get_state())
    parent = torch.Generator().manual_seed(3)
    children = [_dp_generator(parent, "cpu") for _ in range(3)]
    for child in children:
        assert child is not parent
        assert not from_32_bit_seed(child.get_state())
    assert len({tuple(mt_words(c.get_state())) for c in children}) == 3  # one per draw
    again = torch.Generator().manual_seed(3)
    assert torch.equal(_dp_generator(again, "cpu").get_state(), children[0].get_state())
