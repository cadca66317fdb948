"""The topology object (one process / replicas / FSDP2 shards), the functional release, the step's
objects and hooks, and the engine's checked configuration."""
import ast
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
import private_engine.checkpoint as checkpoint_module
import private_engine.engine as engine_module
import private_engine.optim.private_step as private_step_module
from private_engine.clipping.grad_sums import GradSums
from private_engine.engine_config import EngineConfig, check_max_grad_norm
from private_engine.optim import NoiseSpec, SingleProcess, release_gradient
from private_engine.optim.noise import add_gaussian_noise


def _engine(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, **{"batch_size": 4, "sample_size": 40,
                                            "max_grad_norm": 1.0, "noise_multiplier": 0.0,
                                            **kwargs})
    return model, engine


def _batch(model, n=4):
    x, y = torch.randn(n, 3), torch.randint(0, 2, (n,))
    return F.cross_entropy(model(x), y, reduction="none")


def test_one_process_engine_runs_on_the_single_process_topology():
    _, engine = _engine()
    assert isinstance(engine.topology, SingleProcess)
    assert engine.distributed is None and not engine.sharded and engine.draws_noise
    assert engine.topology.records and engine.topology.state_tag() is None


def test_release_gradient_is_noise_once_then_division_by_B():
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(5))]
    sums = [torch.randn(2, 3), torch.randn(5)]
    sigma, R, B = 0.7, 2.5, 8
    noise = NoiseSpec(sigma, B, torch.Generator().manual_seed(3))
    expected = [s.clone() for s in sums]
    add_gaussian_noise(expected, sigma * R, torch.Generator().manual_seed(3))
    grads = release_gradient(GradSums(grads=list(sums), buffers=list(sums), layout=None), params,
                             noise, R, SingleProcess())
    for g, e in zip(grads, expected):
        assert torch.equal(g, e / B)


def test_private_step_takes_objects_and_hooks_have_removable_handles():
    model, engine = _engine()
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    (step,) = engine.attached_steps
    assert step.clipping is engine and step.accounting is engine.accounting
    assert step.topology is engine.topology
    seen = []
    handle = step.register_step_post_hook(lambda s, samples: seen.append(samples))
    optimizer.step(loss=_batch(model, 4))
    handle.remove()
    optimizer.step(loss=_batch(model, 3))
    assert seen == [4] and engine.steps_taken == 2


def test_accounting_state_dict_is_what_the_engine_state_holds():
    model, engine = _engine()
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.step(loss=_batch(model))
    state = engine.state_dict()
    part = engine.accounting.state_dict()
    assert state["accountant"] == part["accountant"] and state["ledger"] == part["ledger"]
    assert part["accountant"]["history"] == [(0.0, 0.1, 1)]
    _, other = _engine()
    other.accounting.load_state_dict(part)
    assert other.steps_taken == 1 and other.accountant.history == engine.accountant.history


@pytest.mark.parametrize("module", [engine_module, private_step_module, checkpoint_module])
def test_no_distribution_flag_is_asked_outside_the_topology(module):
    source = inspect.getsource(module)
    tree = ast.parse(source)
    asks = [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"]
    asks += [ast.unparse(node) for node in ast.walk(tree)
             if isinstance(node, (ast.If, ast.IfExp))
             and any(w in ast.unparse(node.test) for w in ("sharded", "distributed"))]
    assert asks == []


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "1", None])
def test_one_max_grad_norm_check_for_the_config_and_the_setter(bad):
    with pytest.raises(ValueError) as direct:
        check_max_grad_norm(bad)
    with pytest.raises(ValueError) as config:
        EngineConfig(batch_size=4, sample_size=40, max_grad_norm=bad, noise_multiplier=1.0)
    _, engine = _engine()
    with pytest.raises(ValueError) as setter:
        engine.max_grad_norm = bad
    assert str(direct.value) == str(config.value) == str(setter.value)
    assert "max_grad_norm must be a finite number > 0" in str(direct.value)


def test_config_checks_and_calibrates_as_the_engine_does():
    with pytest.raises(ValueError, match="exactly one of noise_multiplier or target_epsilon"):
        EngineConfig(batch_size=4, sample_size=40, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="sample_size must be an integer"):
        EngineConfig(batch_size=4, sample_size=3, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number"):
        EngineConfig(batch_size=4, sample_size=40, max_grad_norm=1.0, noise_multiplier=-1.0)
    config = EngineConfig(batch_size=4, sample_size=40, max_grad_norm=1.0, target_epsilon=3.0,
                          epochs=2)
    _, engine = _engine(noise_multiplier=None, target_epsilon=3.0, epochs=2)
    assert config.noise() == (engine.noise_multiplier, engine.steps)
    assert (config.sample_rate, config.delta) == (engine.sample_rate, engine.target_delta)
