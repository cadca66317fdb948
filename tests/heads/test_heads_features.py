"""extract_features: penultimate features of timm/torchvision backbones, batching, disk cache keyed
by model, weights and data, and resuming an interrupted extraction."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from private_engine.heads.features import extract_features, model_fingerprint, penultimate_features


class Counting(nn.Module):
    """A small CNN classifier that counts its forward calls."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                                  nn.Flatten())
        self.fc = nn.Linear(16, 5)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(self.body(x))


def images(n=37, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 5, (n,), generator=g)


def test_timm_penultimate_features():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8,
                              depth=1, num_classes=3).eval()
    x, _ = images(10, 16)
    fs = extract_features(model, x, batch_size=4, progress=False)
    with torch.no_grad():
        expected = model.forward_head(model.forward_features(x), pre_logits=True)
        assert fs.features.shape == (10, 192)
        torch.testing.assert_close(fs.features, expected, rtol=1e-5, atol=1e-5)
        # the classifier applied to them gives the model's logits: they really are penultimate
        torch.testing.assert_close(model.head(fs.features), model(x), rtol=1e-4, atol=1e-5)
    assert fs.labels is None and fs.cache_path is None


def test_torchvision_penultimate_features_are_the_classifier_input():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=7).eval()
    x, y = images(6, 32)
    fs = extract_features(model, x, batch_size=4, labels=y, progress=False)
    with torch.no_grad():
        trunk = nn.Sequential(*list(model.children())[:-1])
        torch.testing.assert_close(fs.features, trunk(x).flatten(1), rtol=1e-5, atol=1e-5)
    assert torch.equal(fs.labels, y)


def test_dataset_and_loader_inputs_and_named_layer():
    model = Counting().eval()
    x, y = images()
    ds = TensorDataset(x, y)
    a = extract_features(model, ds, batch_size=8, progress=False)
    b = extract_features(model, DataLoader(ds, batch_size=5, shuffle=True), batch_size=8,
                         progress=False)
    with torch.no_grad():
        expected = model.body(x)
    torch.testing.assert_close(a.features, expected)
    # the loader's shuffling is ignored: order is kept
    torch.testing.assert_close(b.features, expected)
    assert torch.equal(a.labels, y)
    c = extract_features(model, x, batch_size=8, layer="body.3", progress=False)  # input of Flatten
    assert c.features.shape == (37, 16)
    with pytest.raises(ValueError, match="no submodule"):
        penultimate_features(model, x, layer="nope")


def test_cache_hit_and_keys(tmp_path):
    model = Counting().eval()
    x, y = images()
    first = extract_features(model, x, batch_size=10, labels=y, cache_dir=tmp_path, progress=False)
    assert model.calls == 4 and first.cache_path.exists()
    again = extract_features(model, x, batch_size=10, labels=y, cache_dir=tmp_path, progress=False)
    assert model.calls == 4  # served from disk
    assert torch.equal(again.features, first.features) and torch.equal(again.labels, y)
    # new weights → new key
    with torch.no_grad():
        model.fc.weight[0, 0] += 1.0
        model.body[0].weight[0, 0, 0, 0] += 1.0
    changed = extract_features(model, x, batch_size=10, labels=y, cache_dir=tmp_path,
                               progress=False)
    assert model.calls == 8 and changed.cache_path != first.cache_path
    assert not torch.allclose(changed.features, first.features)
    # new data → new key
    x2 = x.clone()
    x2[3, 0, 0, 0] += 1
    extract_features(model, x2, batch_size=10, labels=y, cache_dir=tmp_path, progress=False)
    assert model.calls == 12
    # a different transform id → new key
    extract_features(model, x, batch_size=10, labels=y, cache_dir=tmp_path,
                     transform=lambda t: t * 2, transform_id="x*2", progress=False)
    assert model.calls == 16
    assert model_fingerprint(model) != model_fingerprint(Counting())


def test_interrupted_extraction_resumes(tmp_path):
    model = Counting().eval()
    x, y = images(50)
    reference = extract_features(model, x, batch_size=8, progress=False).features
    state = {"n": 0}

    def flaky(t):
        state["n"] += 1
        if state["n"] == 4:
            raise KeyboardInterrupt("simulated interruption")
        return t

    model.calls = 0
    with pytest.raises(KeyboardInterrupt):
        extract_features(model, x, batch_size=8, cache_dir=tmp_path, transform=flaky,
                         transform_id="id", progress=False)
    assert model.calls == 3
    parts = list(tmp_path.glob("*/parts/part-*.pt"))
    assert len(parts) == 3
    resumed = extract_features(model, x, batch_size=8, cache_dir=tmp_path, transform=flaky,
                               transform_id="id", progress=False)
    assert model.calls == 3 + 4  # only the 4 missing batches of 7 were computed
    torch.testing.assert_close(resumed.features, reference)
    assert not list(tmp_path.glob("*/parts/part-*.pt"))  # consolidated into features.pt


def test_model_by_name_and_errors():
    pytest.importorskip("timm")
    x, _ = images(3, 16)
    # built offline, random weights
    fs = extract_features("resnet10t", x, batch_size=2, progress=False)
    assert fs.features.shape == (3, 512)
    with pytest.raises(ValueError, match="batch_size"):
        extract_features(Counting(), x, batch_size=0)
    with pytest.raises(TypeError, match="data must be"):
        extract_features(Counting(), object())
