"""Nothing of a batch (activations, outputs, autograd graph) outlives its step."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import MODES


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["step", "virtual_step"])
def test_batch_tensors_are_freed_after_the_step(mode, how):
    torch.manual_seed(0)
    model = _Net()
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=1.0, clipping_mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))
    loss = F.cross_entropy(model(x), y, reduction="none")
    records = [weakref.ref(c) for layer in engine.clipper.recorder.layers for c in layer.calls]
    assert len(records) == 3
    getattr(opt, how)(loss=loss)
    del loss
    gc.collect()
    assert all(not layer.calls for layer in engine.clipper.recorder.layers)
    # a record (holding an activation and graph edges) kept alive by its own tensor hook would keep
    # the whole autograd graph of the batch alive: memory growing step after step
    assert all(r() is None for r in records), "records of the batch are still alive after the step"
