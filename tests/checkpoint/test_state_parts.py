"""The parts a checkpoint composes give their own state: the engine's attached private steps (and
whether one holds a logical batch in progress), the loss scaling's ``state_dict`` (the fixed scale
only, never a dynamic one); and the checkpoint module reads no private attribute of another
object."""
import ast
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
import private_engine.checkpoint as checkpoint_module
from private_engine.clipping.loss_scaling import LossScaling

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, batch_size=4, sample_size=32, max_grad_norm=1.0,
                                  noise_multiplier=1.0,
                                  noise_generator=torch.Generator().manual_seed(0))
    return model, engine


def test_attached_steps_follow_attach_detach_and_accumulation():
    model, engine = _engine()
    assert engine.attached_steps == []
    opt = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    (step,) = engine.attached_steps
    assert step.optimizer is opt and not step.accumulating
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 0])
    opt.virtual_step(loss=F.cross_entropy(model(x), y, reduction="none"))
    assert step.accumulating
    opt.step(loss=F.cross_entropy(model(x), y, reduction="none"))
    assert not step.accumulating
    engine.detach()
    assert engine.attached_steps == []


@pytest.mark.parametrize("dynamic", [False, True])
def test_loss_scaling_state_is_the_fixed_scale_only(dynamic):
    scaling = LossScaling(torch.amp.GradScaler("cpu", init_scale=2.0 ** 5), dynamic=dynamic)
    state = scaling.state_dict()
    if dynamic:
        assert state is None
        return
    assert state["scaler"]["scale"] == 2.0 ** 5
    other = LossScaling(torch.amp.GradScaler("cpu", init_scale=2.0 ** 2))
    other.overflow_batches = 3
    other.load_state_dict(state)
    assert other.scaler.get_scale() == 2.0 ** 5 and other.overflow_batches == 3
    assert LossScaling(None).state_dict() is None
    LossScaling(None).load_state_dict(state)  # no scaler: nothing to restore


def test_checkpoint_reads_no_private_attribute_of_another_object():
    tree = ast.parse(inspect.getsource(checkpoint_module))
    reads = [f"line {node.lineno}: .{node.attr}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr.startswith("_")
             and not node.attr.startswith("__")
             and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert reads == []
