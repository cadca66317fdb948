"""The procedural warm-start images: deterministic per (seed, index), shapes, range, families,
variety, and the normalised data set."""
import time

import pytest
import torch

from private_engine.pretrain.synthetic import CHUNK, FAMILIES, SyntheticImages, synthetic_images


def test_deterministic_and_prefix_stable():
    a = synthetic_images(CHUNK + 40, size=16, seed=3)
    b = synthetic_images(CHUNK + 40, size=16, seed=3)
    assert torch.equal(a, b)
    assert torch.equal(synthetic_images(25, size=16, seed=3), a[:25])  # image j: (seed, j) only
    assert not torch.equal(synthetic_images(25, size=16, seed=4), a[:25])


@pytest.mark.parametrize("size,channels", [(8, 3), (32, 1), (17, 3)])
def test_shape_dtype_range(size, channels):
    x = synthetic_images(64, size=size, channels=channels, seed=0)
    assert x.shape == (64, channels, size, size) and x.dtype == torch.float32
    assert torch.isfinite(x).all() and x.min() >= 0 and x.max() <= 1
    assert synthetic_images(0, size=size).shape == (0, 3, size, size)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_has_structure_and_variety(family):
    x = synthetic_images(64, size=32, seed=1, families=[family])
    spatial = x.flatten(2).std(-1).mean()  # within-image variation (not flat colour)
    assert spatial > 0.02, family
    between = x.mean(dim=(2, 3)).std(0).mean()  # images differ from each other
    assert between > 0.02, family
    # no two images identical
    flat = x.flatten(1)
    assert torch.cdist(flat, flat).add(torch.eye(64) * 1e9).min() > 0


def test_unknown_family_refused():
    with pytest.raises(ValueError, match="unknown image families"):
        synthetic_images(4, families=["clouds"])


def test_dataset_normalises_with_fixed_constants():
    ds = SyntheticImages(10, size=8, seed=2)
    x, y = ds[3]
    raw = synthetic_images(10, size=8, seed=2)[3]
    assert y == 0 and len(ds) == 10
    torch.testing.assert_close(x, (raw - 0.5) / 0.5, atol=2 / 255 + 1e-6, rtol=0)


def test_speed_is_reported_not_asserted(capsys):
    t0 = time.perf_counter()
    synthetic_images(2048, size=32, seed=0)
    print(f"2048 images 32×32: {time.perf_counter() - t0:.2f} s")
