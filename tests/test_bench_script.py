"""bench/bench_clipping.py's bookkeeping (no timing): which parameters each method trains, how results are
paired and reported. The measurements themselves are never asserted in tests."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_clipping", ROOT / "bench" / "bench_clipping.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_models_default_per_device_and_list(bench):
    assert bench.parse_args(["--device", "cpu"]).models == ["vit_tiny_patch16_224"]
    assert bench.parse_args(["--device", "cuda"]).models == [
        "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224"]
    args = bench.parse_args(["--device", "cpu", "--models", "resnet18", "vit_tiny_patch16_224"])
    assert args.models == ["resnet18", "vit_tiny_patch16_224"] and args.model == "resnet18"
    assert bench.parse_args(["--device", "cpu", "--model", "resnet18"]).models == ["resnet18"]


def test_child_command_forwards_one_model_and_the_frozen_set(bench):
    args = bench.parse_args(["--device", "cpu", "--models", "a", "b", "--frozen-set", "pos_embed"])
    args.model = "b"
    cmd = bench.child_command(args, "mixed_frozen")
    assert cmd[cmd.index("--model") + 1] == "b" and cmd[cmd.index("--frozen-set") + 1] == "pos_embed"
    assert bench.parse_args(cmd[2:]).only == "mixed_frozen"


def test_only_the_frozen_methods_freeze_the_token_parameters(bench):
    args = bench.parse_args(["--device", "cpu", "--img-size", "32"])
    model, notes = bench.build_model(args, "mixed")
    assert all(p.requires_grad for p in model.parameters())
    assert notes["frozen_set"] == [] and set(notes["traced"]) == {"cls_token", "pos_embed"} and notes["fallback"] == []
    frozen_model, frozen_notes = bench.build_model(args, "opacus_hooks_frozen")
    assert frozen_notes["frozen_set"] == ["cls_token", "pos_embed"]
    assert [n for n, p in frozen_model.named_parameters() if not p.requires_grad] == ["cls_token", "pos_embed"]
    assert frozen_notes["trainable"] == notes["trainable"] - model.cls_token.numel() - model.pos_embed.numel()


def test_opacus_on_root_owned_parameters_is_reported_as_whole_model_functorch(bench):
    from opacus import GradSampleModule

    args = bench.parse_args(["--device", "cpu", "--img-size", "32"])
    model, _ = bench.build_model(args, "opacus_hooks")
    assert bench.opacus_functorch_modules(GradSampleModule(model)) == ["VisionTransformer (the whole model)"]
    frozen, _ = bench.build_model(args, "opacus_hooks_frozen")
    names = bench.opacus_functorch_modules(GradSampleModule(frozen))
    assert "VisionTransformer (the whole model)" not in names and "blocks.0.attn.qkv" not in names


def test_errors_keep_the_names_from_later_lines(bench):
    e = ValueError("these trainable parameters have no per-sample clipping rule yet:\n"
                   "  VisionTransformer: cls_token, pos_embed\nFreeze them. Or else.")
    assert bench.error_text(e) == ("ValueError: these trainable parameters have no per-sample clipping rule yet: "
                                   "VisionTransformer: cls_token, pos_embed Freeze them")


def _result(median, mem, **extra):
    return {"median_s": median, "times": [median], "peak_delta_mib": mem, "first_step_peak_delta_mib": mem,
            "held_mib": 0.0, "trainable": 10, **extra}


def test_ours_is_compared_with_opacus_on_the_same_parameters(bench):
    results = {"nondp": _result(1.0, 10), "mixed": {"error": "ValueError: no rule", "trainable": 10},
               "opacus_hooks": _result(4.0, 40), "opacus_ghost": {"error": "boom"},
               "mixed_frozen": _result(1.5, 15), "opacus_hooks_frozen": _result(3.0, 60),
               "opacus_ghost_frozen": _result(6.0, 30)}
    rows = bench.versus_opacus_table(results)
    assert rows[0] == ["ours", "time / opacus_hooks", "time / opacus_ghost", "mem / opacus_hooks", "mem / opacus_ghost"]
    assert rows[1:] == [["mixed_frozen", "0.50×", "0.25×", "0.25×", "0.50×"]]
    table = bench.results_table(results)
    mixed = next(r for r in table if r[0] == "mixed")
    assert mixed[1] == "10" and mixed[-1] == "ValueError: no rule"


def test_cpu_target_line(bench):
    args = bench.parse_args(["--device", "cpu"])
    results = {"nondp": _result(1.0, 10), "mixed": _result(1.1, 10, time_ratio=1.15),
               "ghost": _result(2.0, 10), "per_sample": {"error": "ValueError: no rule"}}
    (line,) = bench.target_lines(args, results)
    assert "mixed: 1.15× (met)" in line and "ghost: 2.00× (not met)" in line and "per_sample: failed" in line
    assert bench.target_lines(bench.parse_args(["--device", "cuda"]), results) == []


def test_frozen_variant_is_skipped_when_nothing_matches(bench):
    args = bench.parse_args(["--device", "cpu", "--model", "resnet18", "--img-size", "32"])
    with pytest.raises(bench.Skip) as info:
        bench.build_model(args, "mixed_frozen")
    assert bench.error_text(info.value).startswith("skipped: no parameter matches --frozen-set cls_token")
    results = {"nondp": _result(1.0, 10), "mixed": _result(1.5, 10), "mixed_frozen": {"error": "skipped: same"}}
    (line,) = bench.target_lines(args, results)
    assert "mixed_frozen" not in line
