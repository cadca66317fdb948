"""Nothing of a batch (activations, outputs, autograd graph) outlives its step; the clipped sums
are never held twice."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import private_engine as pe
import private_engine.clipping.sums as sums_module
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


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive, and their peak: each
    storage an operator creates (outputs aliasing no input) counted once, until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self._seen:
                    s = t.untyped_storage()
                    self._seen.add(id(s))
                    self.live += s.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(s, self._freed, id(s), s.nbytes())
        return out

    def _freed(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes


@pytest.mark.parametrize("mode", ["bk_mixed", "bk", "mixed"])
def test_clipped_sums_never_sit_twice_in_memory(monkeypatch, mode):
    """The clipped sums are written into flat buffers allocated as they are reached and copied
    out to the released gradients one buffer at a time: a step's memory above the forward stays
    within the gradients' size and one buffer (plus the batch's small operands), not the sums'
    buffer and a full copy of it (twice the model's gradient size)."""
    monkeypatch.setattr(sums_module, "SUM_BUFFER_ELEMENTS", 20_000, raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(128, 128), nn.Tanh())],
                          nn.Linear(128, 3))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = pe.PrivacyEngine(model, batch_size=2, sample_size=20, max_grad_norm=1.0,
                              noise_multiplier=0.0, clipping_mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = torch.randn(2, 128), torch.tensor([0, 2])
    for _ in range(2):  # the second step runs with the layout of the first
        loss = F.cross_entropy(model(x), y, reduction="none")
        opt.zero_grad(set_to_none=True)
        with _LiveBytes() as tracked:
            opt.step(loss=loss)
        del loss
    # each Linear's sums (16,512 elements) fill one buffer: the whole is 4.5 buffers
    assert tracked.peak < 1.5 * grad_bytes, (tracked.peak, grad_bytes)
