"""examples/finetune_timm_vit.py and private_engine.demo.image_data: data sources, resizing,
BatchNorm fix, AMP.

Nothing is downloaded: image folders are written to tmp_path, CIFAR-10 is a fake torchvision
layout (its md5 check patched out), ``--pretrained`` is checked up to the hub call.
"""
import importlib.util
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import private_engine as pe
from private_engine.demo.image_data import (
    image_transform,
    load_image_data,
    model_data_config,
    num_classes,
)
from reference import assert_close_rel, reference_clipped_sum

ROOT = Path(__file__).resolve().parents[2]
FINAL = re.compile(r"^ε=([0-9.]+) δ=([0-9.e+-]+) σ=([0-9.]+) accuracy=([0-9.]+) seconds=([0-9.]+)$")
TINY_VIT = ["--img-size", "16", "--patch-size", "4", "--depth", "1"]


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_timm_vit",
                                                  ROOT / "examples" / "finetune_timm_vit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_folder(root: Path, classes=("cat", "dog", "owl"), per_class=6, seed=0):
    """Random RGB PNGs of varying sizes (so resizing is needed) in ``root/<class>/``."""
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (10 + i, 13, 3), dtype=np.uint8)).save(
                root / c / f"{i}.png")


def final_line(out: str):
    last = out.strip().splitlines()[-1]
    m = FINAL.match(last)
    assert m, last
    eps, delta, sigma, acc, seconds = map(float, m.groups())
    return eps, delta, sigma, acc


def run_example(argv, capsys):
    acc = load_example().main(argv)
    out = capsys.readouterr().out
    return acc, out


# -- preprocessing ---------------------------------------------------------------------------------
def test_transform_resizes_and_normalises_with_the_model_config():
    config = {"input_size": (3, 7, 5), "mean": (0.1, 0.2, 0.3), "std": (0.5, 0.25, 2.0),
              "interpolation": "bicubic"}
    rgb = (40, 128, 255)
    x = image_transform(config)(Image.new("RGB", (11, 3), rgb))  # PIL size is (width, height)
    assert x.shape == (3, 7, 5)
    for c in range(3):  # a constant image stays constant under resizing: (v/255 − mean)/std exactly
        expected = (rgb[c] / 255 - config["mean"][c]) / config["std"][c]
        assert torch.allclose(x[c], torch.full((7, 5), expected), atol=1e-6)


def test_model_config_follows_timm_and_the_size_override():
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=3)
    assert model_data_config(vit)["input_size"] == (3, 224, 224)
    assert model_data_config(vit)["mean"] == (0.5, 0.5, 0.5)
    cnn = timm.create_model("resnet10t", num_classes=3)
    cfg = model_data_config(cnn, img_size=24)
    assert cfg["input_size"] == (3, 24, 24) and cfg["mean"] == pytest.approx((0.485, 0.456, 0.406))


def test_digits_use_the_model_normalisation():
    config = {"input_size": (3, 12, 12), "mean": (0.2, 0.4, 0.6), "std": (0.5, 0.5, 2.0),
              "interpolation": "bicubic"}
    train, test, classes = load_image_data("digits", config)
    from private_engine.demo.digits import load_digits_images

    raw_train, raw_test = load_digits_images(image_size=12, channels=3, normalize=False)
    assert (classes == [str(k) for k in range(10)] and len(train) == len(raw_train)
            and len(test) == len(raw_test))
    x, y = train.tensors
    assert x.shape[1:] == (3, 12, 12) and torch.equal(y, raw_train.tensors[1])
    for c in range(3):
        expected = (raw_train.tensors[0][:, c] - config["mean"][c]) / config["std"][c]
        assert torch.allclose(x[:, c], expected, atol=1e-6)


# -- image folder ----------------------------------------------------------------------------------
def test_flat_folder_is_split_80_20_and_resized(tmp_path):
    write_folder(tmp_path / "imgs", per_class=5)
    config = {"input_size": (3, 9, 9), "mean": (0.5,) * 3, "std": (0.5,) * 3,
              "interpolation": "bilinear"}
    train, test, classes = load_image_data("folder", config, tmp_path / "imgs", seed=3)
    assert classes == ["cat", "dog", "owl"] and num_classes("folder", tmp_path / "imgs") == 3
    assert (len(train), len(test)) == (12, 3)
    assert set(train.indices).isdisjoint(test.indices)
    x, y = train[0]
    assert x.shape == (3, 9, 9) and 0 <= y < 3


@pytest.mark.parametrize("amp", [[], ["fp16"]], ids=["bf16", "fp16"])
def test_example_trains_on_an_image_folder_with_amp(tmp_path, capsys, amp):
    write_folder(tmp_path / "train", per_class=8)
    write_folder(tmp_path / "val", per_class=2, seed=1)
    acc, out = run_example(["--data", "folder", "--data-dir", str(tmp_path), *TINY_VIT,
                            "--epochs", "1", "--batch-size", "8", "--physical-batch-size", "5",
                            "--epsilon", "3", "--amp", *amp],
                           capsys)
    expected = "float16 autocast + GradScaler" if amp else "bfloat16 autocast"
    assert "at 16×16" in out and "3 classes" in out and "n=24, test 6" in out and expected in out
    eps, delta, sigma, final_acc = final_line(out)
    assert 0 < eps <= 3 + 1e-6 and delta == pytest.approx(1 / 48, rel=1e-2) and sigma > 0
    assert final_acc == pytest.approx(acc, abs=5e-4) and acc in {k / 6 for k in range(7)}


def test_example_refuses_float16_with_a_two_pass_mode():
    with pytest.raises(SystemExit, match="book-keeping"):
        load_example().main(["--amp", "fp16", "--clipping-mode", "mixed", "--epochs", "0"])


def test_mismatched_class_folders_are_refused(tmp_path):
    write_folder(tmp_path / "train", classes=("a", "b"))
    write_folder(tmp_path / "val", classes=("a", "c"))
    config = {"input_size": (3, 8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3,
              "interpolation": "bilinear"}
    with pytest.raises(ValueError, match="must be the same folders"):
        load_image_data("folder", config, tmp_path)


def test_missing_folder_says_what_is_expected(tmp_path):
    config = {"input_size": (3, 8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3,
              "interpolation": "bilinear"}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_image_data("folder", config, tmp_path / "nope")


# -- CIFAR ----------------------------------------------------------------------------------------
def write_fake_cifar10(root: Path, per_file=4, seed=0):
    """torchvision's CIFAR-10 layout with tiny random batches (the real md5 sums will not match)."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    labels = {}
    for name in [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_file, 3 * 32 * 32), dtype=np.uint8)
        labels[name] = rng.integers(0, 10, per_file).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels[name]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{k}" for k in range(10)]}, f)
    return labels


def test_fake_cifar10_layout_loads_and_trains(tmp_path, capsys, monkeypatch):
    import torchvision.datasets.cifar as cifar

    labels = write_fake_cifar10(tmp_path)
    monkeypatch.setattr(cifar, "check_integrity", lambda *a, **k: True)  # the only thing faked
    config = {"input_size": (3, 16, 16), "mean": (0.5,) * 3, "std": (0.5,) * 3,
              "interpolation": "bilinear"}
    train, test, classes = load_image_data("cifar10", config, tmp_path)
    assert (len(train), len(test), len(classes)) == (20, 4, 10)
    assert [test[i][1] for i in range(4)] == labels["test_batch"]
    assert test[0][0].shape == (3, 16, 16)

    acc, out = run_example(["--data", "cifar10", "--data-dir", str(tmp_path), *TINY_VIT,
                            "--epochs", "1", "--batch-size", "8", "--subset", "16"], capsys)
    assert "10 classes), n=16, test 4" in out
    eps, *_ = final_line(out)
    assert 0 < eps <= 8 + 1e-6


def test_absent_cifar_gives_a_clear_error(tmp_path):
    config = {"input_size": (3, 8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3,
              "interpolation": "bilinear"}
    with pytest.raises(FileNotFoundError,
                       match=r"cifar-100-python.*never downloads.*download=True"):
        load_image_data("cifar100", config, tmp_path)
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        num_classes("cifar10", tmp_path)  # checked before the model is built
    (tmp_path / "cifar-10-batches-py").mkdir()  # present but empty: torchvision's check fails
    with pytest.raises(FileNotFoundError, match="incomplete or corrupted"):
        load_image_data("cifar10", config, tmp_path)


def test_example_exits_with_the_error_text_when_cifar_is_absent(tmp_path):
    with pytest.raises(SystemExit) as info:
        load_example().cli(["--data", "cifar10", "--data-dir", str(tmp_path), "--epochs", "1"])
    assert str(info.value.code).startswith(
        f"error: cifar10 is not on disk: expected torchvision's {tmp_path}")


# -- models ----------------------------------------------------------------------------------------
def test_batchnorm_cnn_is_fixed_and_trains(tmp_path, capsys):
    write_folder(tmp_path / "imgs", per_class=6)
    acc, out = run_example(["--model", "resnet10t", "--data", "folder",
                            "--data-dir", str(tmp_path / "imgs"), "--img-size", "16",
                            "--epochs", "1", "--batch-size", "6"], capsys)
    assert re.search(r"BatchNorm → GroupNorm \(private_engine.fix_batchnorm\): \d+ layers", out)
    assert "resnet10t at 16×16" in out and "frozen" not in out
    final_line(out)


def test_pretrained_and_presets_reach_the_model_factory(monkeypatch):
    """--pretrained goes to timm's hub loader (stopped here: no network) with the model's own
    architecture; the digits preset is used only without it."""
    import timm

    example = load_example()
    calls = []

    def fake_create_model(name, pretrained=False, **kwargs):
        calls.append((name, pretrained, kwargs))
        return timm.models.create_model(name, pretrained=False, **{**kwargs, "depth": 1})

    monkeypatch.setattr(timm, "create_model", fake_create_model)
    example.build_model(example.parse_args(["--pretrained"]), 10)
    example.build_model(example.parse_args([]), 10)
    example.build_model(
        example.parse_args(["--data", "folder", "--data-dir", "x", "--img-size", "64"]), 7)
    example.build_model(example.parse_args(["--pretrained", "--global-pool", "avg"]), 10)
    (n1, pre1, kw1), (n2, pre2, kw2), (n3, pre3, kw3), (n4, pre4, kw4) = calls
    assert pre1 is True and kw1 == {"num_classes": 10}
    # the checkpoint's cls_token is kept
    assert pre4 is True and kw4 == {"num_classes": 10, "global_pool": "avg"}
    assert pre2 is False and kw2 == {"num_classes": 10, "img_size": 8, "patch_size": 2, "depth": 4,
                                     "class_token": False, "global_pool": "avg"}
    assert pre3 is False and kw3 == {"num_classes": 7, "img_size": 64}


def test_cnn_on_digits_gets_32px(monkeypatch):
    args = load_example().parse_args(["--model", "resnet18"])
    assert args.img_size == 32 and args.patch_size is None and args.depth is None


def test_float16_amp_is_refused_with_a_reason(monkeypatch):
    example = load_example()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(SystemExit, match="loss scaling"):
        example.autocast(example.parse_args(["--amp", "--device", "cuda"]))


def test_bfloat16_autocast_clipping_is_within_bfloat16_precision_of_the_reference():
    """What --amp enables: the clipped sum from a bf16-autocast forward vs the float64 reference.

    bfloat16 has 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per operation): the errors stay
    near that, far below what a wrong norm (e.g. one sample's clip factor applied to another)
    would give. float32 is checked on the same case as a control.
    """
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, depth=1,
                              num_classes=10, class_token=False, global_pool="avg")
    model.pos_embed.requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 10, (6,), generator=gen)

    def loss_fn(m, xb, yb):
        return F.cross_entropy(m(xb), yb, reduction="none")

    R = 0.1  # below every norm (≈ 13): every sample is clipped, by its own factor

    def abadi(norms, r):
        return torch.clamp(r / (norms + 1e-6), max=1.0)

    ref, ref_norms = reference_clipped_sum(model, (x, y), loss_fn, R, abadi)
    engine = pe.PrivacyEngine(model, batch_size=6, sample_size=100, noise_multiplier=0.0,
                              max_grad_norm=R, steps=1, clipping_fn="abadi")
    grads32, _ = engine.clipped_grad_sum(loss_fn(model, x, y))
    # float32: each sample is clipped by a certified upper bound of its norm from float32 Grams,
    # whose rounding slack (γ_w·‖a‖·‖g‖ terms, private_engine.layers.gram) is ~1e-5 here
    assert_close_rel(grads32, ref, rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model, x, y)
    grads16, _ = engine.clipped_grad_sum(loss)
    assert all(g.dtype == torch.float32 for g in grads16)
    assert torch.allclose(engine.last_norms.double(), ref_norms, rtol=1e-2)
    assert_close_rel(grads16, ref, rtol=2e-2)
