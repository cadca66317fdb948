"""The clipping benchmark's bookkeeping (no timing): which parameters each method trains, how
results are paired and reported; and a tiny run of each investigation script. The measurements
themselves are never asserted. Run by ``make bench-test`` (not part of ``make test``)."""
import sys
from pathlib import Path

import pytest

from bench.clipping import (
    cli,
    config,
    maxbatch,
    measure,
    methods,
    models,
    plot,
    report,
    schedule,
    tables,
)

ROOT = Path(__file__).resolve().parents[2]


def test_models_default_per_device_and_list():
    assert cli.parse_args(["--device", "cpu"]).models == ["vit_tiny_patch16_224"]
    assert cli.parse_args(["--device", "cuda"]).models == [
        "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "resnet18",
        "resnet50", "vgg11", "text_transformer"]
    args = cli.parse_args(["--device", "cpu", "--models", "resnet18", "vit_tiny_patch16_224"])
    assert args.models == ["resnet18", "vit_tiny_patch16_224"] and args.model == "resnet18"
    assert cli.parse_args(["--device", "cpu", "--model", "resnet18"]).models == ["resnet18"]


def test_child_command_forwards_one_model_and_the_frozen_set():
    args = cli.parse_args(["--device", "cpu", "--models", "a", "b", "--frozen-set", "pos_embed"])
    args.model = "b"
    cmd = cli.child_command(args, "mixed_frozen")
    assert cmd[cmd.index("--model") + 1] == "b"
    assert cmd[cmd.index("--frozen-set") + 1] == "pos_embed"
    assert cli.parse_args(cmd[2:]).only == "mixed_frozen"


def test_only_the_frozen_methods_freeze_the_token_parameters():
    args = cli.parse_args(["--device", "cpu", "--img-size", "32"])
    model, notes = models.build_model(args, "mixed")
    assert all(p.requires_grad for p in model.parameters())
    assert notes["frozen_set"] == [] and notes["fallback"] == []
    assert set(notes["traced"]) == {"cls_token", "pos_embed"}
    frozen_model, frozen_notes = models.build_model(args, "opacus_hooks_frozen")
    assert frozen_notes["frozen_set"] == ["cls_token", "pos_embed"]
    frozen = [n for n, p in frozen_model.named_parameters() if not p.requires_grad]
    assert frozen == ["cls_token", "pos_embed"]
    tokens = model.cls_token.numel() + model.pos_embed.numel()
    assert frozen_notes["trainable"] == notes["trainable"] - tokens


def test_opacus_on_root_owned_parameters_is_reported_as_whole_model_functorch():
    from opacus import GradSampleModule

    args = cli.parse_args(["--device", "cpu", "--img-size", "32"])
    model, _ = models.build_model(args, "opacus_hooks")
    assert methods.opacus_functorch_modules(GradSampleModule(model)) == [
        "VisionTransformer (the whole model)"]
    frozen, _ = models.build_model(args, "opacus_hooks_frozen")
    names = methods.opacus_functorch_modules(GradSampleModule(frozen))
    assert "VisionTransformer (the whole model)" not in names and "blocks.0.attn.qkv" not in names


def test_errors_keep_the_names_from_later_lines():
    e = ValueError("these trainable parameters have no per-sample clipping rule yet:\n"
                   "  VisionTransformer: cls_token, pos_embed\nFreeze them. Or else.")
    assert measure.error_text(e) == ("ValueError: these trainable parameters have no per-sample "
                                     "clipping rule yet: VisionTransformer: cls_token, pos_embed "
                                     "Freeze them")


def _result(median, mem, **extra):
    return {"median_s": median, "times": [median], "peak_delta_mib": mem,
            "first_step_peak_delta_mib": mem, "held_mib": 0.0, "trainable": 10, **extra}


def test_ours_is_compared_with_opacus_on_the_same_parameters():
    results = {"nondp": _result(1.0, 10),
               "mixed": {"error": "ValueError: no rule", "trainable": 10},
               "opacus_hooks": _result(4.0, 40), "opacus_ghost": {"error": "boom"},
               "mixed_frozen": _result(1.5, 15), "opacus_hooks_frozen": _result(3.0, 60),
               "opacus_ghost_frozen": _result(6.0, 30)}
    rows = tables.versus_opacus_table(results)
    assert rows[0] == ["ours", "time / opacus_hooks", "time / opacus_ghost", "mem / opacus_hooks",
                       "mem / opacus_ghost"]
    assert rows[1:] == [["mixed_frozen", "0.50×", "0.25×", "0.25×", "0.50×"]]
    table = tables.results_table(results)
    mixed = next(r for r in table if r[0] == "mixed")
    assert mixed[1] == "10" and mixed[-1] == "ValueError: no rule"


def test_cpu_target_line():
    args = cli.parse_args(["--device", "cpu"])
    results = {"nondp": _result(1.0, 10), "mixed": _result(1.1, 10, time_ratio=1.15),
               "ghost": _result(2.0, 10), "per_sample": {"error": "ValueError: no rule"}}
    (line,) = tables.target_lines(args, results)
    assert "≤ 1.15× non-DP" in line and "vit_tiny_patch16_224 at batch 16" in line
    assert "mixed: 1.15× (met)" in line and "ghost: 2.00× (not met)" in line
    assert "per_sample: failed" in line


def test_cuda_target_lines():
    args = cli.parse_args(["--device", "cuda"])
    results = {"nondp": _result(1.0, 100, max_batch=200), "bk": _result(1.1, 105, max_batch=190),
               "bk_mixed": _result(1.3, 150, max_batch=100),
               "mixed": {"error": "ValueError: no rule"}}
    time_line, mem_line, batch_line = tables.target_lines(args, results)
    assert "bk: 1.10× (met)" in time_line and "bk_mixed: 1.30× (not met)" in time_line
    assert "mixed: failed" in time_line
    assert "≤ 1.1× non-DP" in mem_line and "bk: 1.05× (met)" in mem_line
    assert "bk_mixed: 1.50× (not met)" in mem_line
    assert "≥ 0.9× non-DP" in batch_line and "bk: 0.95× (met)" in batch_line
    assert "bk_mixed: 0.50× (not met)" in batch_line
    for r in results.values():
        r.pop("max_batch", None)
    assert "not measured" in tables.target_lines(args, results)[-1]


def test_frozen_variant_is_skipped_when_nothing_matches():
    args = cli.parse_args(["--device", "cpu", "--model", "resnet18", "--img-size", "32"])
    with pytest.raises(models.Skip) as info:
        models.build_model(args, "mixed_frozen")
    assert measure.error_text(info.value).startswith(
        "skipped: no parameter matches --frozen-set cls_token")
    results = {"nondp": _result(1.0, 10), "mixed": _result(1.5, 10),
               "mixed_frozen": {"error": "skipped: same"}}
    (line,) = tables.target_lines(args, results)
    assert "mixed_frozen" not in line


def test_book_keeping_methods_listed_ordered_and_paired_with_opacus():
    core = ["nondp", "mixed", "ghost", "per_sample", "bk", "bk_mixed", "bk_mixopt", "opacus_hooks",
            "opacus_ghost"]
    assert list(config.METHODS[:9]) == core and {"bk", "bk_mixed", "bk_mixopt"} <= set(config.OURS)
    assert cli.parse_args(["--device", "cpu"]).methods == core
    assert cli.parse_args(["--device", "cpu", "--methods", "all"]).methods == list(config.METHODS)
    chosen = cli.parse_args(["--device", "cpu", "--methods", "opacus_ghost", "bk"]).methods
    assert chosen == ["bk", "opacus_ghost"]
    assert methods.SETUPS["bk_mixopt"] is not methods.SETUPS["bk"]
    results = {"nondp": _result(1.0, 10), "bk": _result(2.0, 10), "bk_mixed": _result(1.0, 20),
               "bk_mixopt": {"error": "ValueError: unknown clipping_mode"},
               "opacus_hooks": _result(4.0, 40), "opacus_ghost": _result(2.0, 20)}
    rows = tables.versus_opacus_table(results)
    assert rows[1:] == [["bk", "0.50×", "1.00×", "0.25×", "0.50×"],
                        ["bk_mixed", "0.25×", "0.50×", "0.50×", "1.00×"]]
    bk_mixopt = next(r for r in tables.results_table(results) if r[0] == "bk_mixopt")
    assert bk_mixopt[-1] == "ValueError: unknown clipping_mode"


def test_text_model_batch_is_token_ids_and_the_model_runs_on_it():
    import torch

    args = cli.parse_args(["--device", "cpu", "--model", "text_transformer", "--seq-len", "12",
                             "--batch-size", "3", "--img-size", "999"])
    x, y = models.make_batch(args)
    assert x.dtype == torch.int64 and x.shape == (3, 12) and y.shape == (3,)
    assert int(x.max()) < config.TEXT_VOCAB
    model, notes = models.build_model(args, "nondp")
    assert notes["traced"] == [] and notes["fallback"] == []  # only layers both libraries know
    assert isinstance(model.positions, torch.nn.Embedding)
    with torch.no_grad():
        assert model(x).shape == (3, args.num_classes)
    again, _ = models.build_model(args, "mixed")  # same initialisation for every method
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert report.section_key(args) == "text_transformer-t12-b3-cpu-float32"
    image = cli.parse_args(["--device", "cpu", "--img-size", "32", "--batch-size", "2"])
    assert models.make_batch(image)[0].shape == (2, 3, 32, 32)


def test_amp_is_forwarded_and_recorded_in_the_section_key():
    plain = cli.parse_args(["--device", "cpu"])
    assert plain.amp == "none"
    assert report.section_key(plain) == "vit_tiny_patch16_224-224-b16-cpu-float32"
    args = cli.parse_args(["--device", "cpu", "--amp", "bf16"])
    assert report.section_key(args) == "vit_tiny_patch16_224-224-b16-cpu-float32-ampbf16"
    cmd = cli.child_command(args, "bk")
    assert cmd[cmd.index("--amp") + 1] == "bf16"
    assert "bfloat16 autocast" in report.setup_lines(args, {})[0]
    assert methods.grad_scaler(args) is None
    assert methods.grad_scaler(cli.parse_args(["--device", "cpu", "--amp", "fp16"]))


def test_max_batch_by_bisection():
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 37

    assert maxbatch.max_batch_by_bisection(fits, 16, 4096) == 37
    assert calls[:3] == [16, 32, 64] and len(calls) <= 3 + 5
    assert maxbatch.max_batch_by_bisection(lambda n: False, 16, 4096) == 0
    assert maxbatch.max_batch_by_bisection(lambda n: True, 16, 4096) == 4096
    # the cap itself is tried
    assert maxbatch.max_batch_by_bisection(lambda n: True, 16, 100) == 100
    assert maxbatch.max_batch_by_bisection(lambda n: n <= 5, 16, 4096) == 5  # below the start
    # a tolerance stops the bisection early, never above the true size nor below it by more
    probes = []
    assert 1100 <= maxbatch.max_batch_by_bisection(
        lambda n: probes.append(n) or n <= 1205, 128, 4096, tolerance=0.05) <= 1205
    exact = []
    maxbatch.max_batch_by_bisection(lambda n: exact.append(n) or n <= 1205, 128, 4096)
    assert len(probes) < len(exact)


def test_max_batch_probe_counts_only_out_of_memory_as_not_fitting(monkeypatch):
    import argparse

    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    # the fake allocator's state: bytes in tensors grow with the batch probed
    allocator = {"allocated": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocator["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved",
                        lambda: allocator["allocated"] + 3 * config.MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda: allocator["allocated"] + config.MIB)
    monkeypatch.setattr(maxbatch, "build_model", lambda args, method: (torch.nn.Linear(1, 1), {}))
    monkeypatch.setattr(maxbatch, "make_batch", lambda args, n: (torch.zeros(n, 1), torch.zeros(n)))

    probed = []

    def setup(model, x, y, args):
        probed.append(args.batch_size)

        def step():
            allocator["allocated"] = args.batch_size * config.MIB
            if args.batch_size >= 32:
                raise RuntimeError("CUDA error: out of memory")
            if args.batch_size > 21:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return methods.Runner(step)

    monkeypatch.setitem(methods.SETUPS, "nondp", setup)
    args = argparse.Namespace(only="nondp", batch_size=4, max_batch_cap=64,
                              max_batch_tolerance=0.0)
    probe = maxbatch.probe_max_batch(args)
    where = probe["oom"].pop("where")
    assert probe == {
        # the allocator at the error of the smallest batch that did not fit, and the request:
        "max_batch": 21,
        "oom": {"batch": 22, "allocated_mib": 22.0, "reserved_mib": 25.0,
                "peak_allocated_mib": 23.0, "request": "2.00 GiB"}}
    assert where.startswith("test_bench_script.py:") and where.endswith("(step)")
    # both kinds of out-of-memory error mean "does not fit"
    assert probed == [4, 8, 16, 32, 24, 20, 22, 21]

    def broken(model, x, y, args):
        raise ValueError("no rule")

    monkeypatch.setitem(methods.SETUPS, "nondp", broken)
    with pytest.raises(ValueError):
        maxbatch.probe_max_batch(args)


def test_max_batch_is_refused_on_cpu(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--max-batch"])
    assert "--max-batch needs --device cuda" in capsys.readouterr().err
    args = cli.parse_args(["--device", "cuda", "--max-batch", "--batch-size", "8"])
    assert args.max_batch and args.max_batch_cap == 4096
    assert "--probe-max-batch" in cli.child_command(args, "bk", probe_max_batch=True)


def test_max_batch_columns():
    bk_oom = {"batch": 96, "allocated_mib": 70000.4, "reserved_mib": 79000.0,
              "peak_allocated_mib": 78500.0, "request": "1.17 GiB",
              "where": "clipping.py:297 (per_sample_norms)"}
    bk_mixed_oom = {"batch": 91, "allocated_mib": 1.0, "reserved_mib": 2.0,
                    "peak_allocated_mib": 3.0}
    results = {"nondp": _result(1.0, 10, max_batch=100, peak_total_mib=50, peak_reserved_mib=60),
               "bk": _result(1.2, 11, max_batch=95, peak_total_mib=51, peak_reserved_mib=64,
                             max_batch_oom=bk_oom),
               "opacus_hooks": _result(2.0, 30, max_batch=None, max_batch_error="crashed",
                                       peak_total_mib=70),
               "bk_mixed": _result(1.1, 11, max_batch=90, peak_total_mib=51, peak_reserved_mib=64,
                                   max_batch_oom=bk_mixed_oom)}
    table = tables.results_table(results, cuda=True)
    header = table[0]
    assert header[-3:] == ["max batch", "max batch × non-DP", "notes"]
    bk = table[2]
    assert bk[header.index("max batch")] == "95"
    assert bk[header.index("max batch × non-DP")] == "0.95×"
    assert bk[header.index("peak reserved (MiB)")] == "64"
    assert table[3][header.index("peak reserved (MiB)")] == "—"
    assert table[3][header.index("max batch")] == "crashed"
    assert report.oom_lines(results) == [
        "bk at batch 96 (first that did not fit): out of memory with 70,000 MiB in tensors and "
        "79,000 MiB reserved (9,000 MiB free inside the allocator's segments); that attempt's peak "
        "in tensors 78,500 MiB; the request that failed: 1.17 GiB, raised in clipping.py:297 "
        "(per_sample_norms).",
        "bk_mixed at batch 91 (first that did not fit): out of memory with 1 MiB in tensors and "
        "2 MiB reserved (1 MiB free inside the allocator's segments); that attempt's peak in "
        "tensors 3 MiB."]


def test_cuda_alloc_conf_reaches_the_children_and_the_section_key():
    args = cli.parse_args(["--device", "cuda", "--cuda-alloc-conf", "expandable_segments:True"])
    assert schedule.child_env(args)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert report.section_key(args).endswith("-alloc-expandable_segments:True")
    plain = cli.parse_args(["--device", "cuda"])
    assert "-alloc" not in report.section_key(plain)


def test_plot_written(tmp_path):
    everything = {"vit_tiny_patch16_224": {"nondp": _result(1.0, 10),
                                           "bk": _result(1.2, 11, time_ratio=1.1),
                                           "bk_mixed": {"error": "ValueError: no rule"},
                                           "mixed_frozen": {"error": "skipped: same as mixed"}},
                  "text_transformer": {"nondp": _result(1.0, 10, max_batch=64),
                                       "opacus_hooks": _result(3.0, 40, max_batch=16)},
                  "resnet18": {"nondp": {"error": "RuntimeError: boom"}}}
    path = tmp_path / "sub" / "plot.png"
    plot.plot_results(everything, path, "cpu, batch 16")
    assert path.exists() and path.stat().st_size > 1000


def test_markdown_defaults_the_plot_next_to_it_and_links_it(tmp_path):
    md = tmp_path / "docs" / "benchmarks.md"
    args = cli.parse_args(["--device", "cpu", "--markdown", str(md)])
    assert args.plot == str(tmp_path / "docs" / "benchmarks_cpu.png") and args.plot_default
    info = {"device": "CPU", "machine": "m", "software": "s"}
    section = report.markdown_section(args, {"nondp": _result(1.0, 10)}, info)
    assert "](benchmarks_cpu.png)" in section
    assert cli.parse_args(["--device", "cpu"]).plot is None


def test_opacus_methods_run_without_inplace_activations():
    """Opacus' backward hooks reject in-place activations (timm ResNets, torchvision VGG): the
    benchmark turns them off for Opacus only and says so; private_engine and non-DP keep them."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(4, 2), torch.nn.ReLU(inplace=True))
    assert models.inplace_activations_off(model) == ["1", "3"]
    assert not any(getattr(m, "inplace", False) for m in model.modules())
    assert models.inplace_activations_off(model) == []


def test_profile_step_reports_each_method(tmp_path, capsys):
    from bench.investigate import profile_step as module

    tiny = ["--device", "cpu", "--models", "text_transformer", "--seq-len", "8",
            "--batch-size", "2"]
    module.main(tiny + ["--methods", "nondp", "bk_mixed", "--steps", "1", "--warmup", "0",
                        "--rows", "3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "== nondp:" in out and "== bk_mixed:" in out and "s/step" in out
    assert (tmp_path / "bk_mixed.txt").exists() and (tmp_path / "bk_mixed.json").exists()
    assert "Input Shapes" not in out
    module.main(tiny + ["--methods", "bk_mixed", "--steps", "1", "--warmup", "0", "--rows", "40",
                        "--by-shape"])
    out = capsys.readouterr().out
    # rows per (operator, shapes): the batch of 2, 8 tokens
    assert "Input Shapes" in out and "[2, 8, " in out


def test_data_movement_records_copies_and_gram_passes(capsys):
    from bench.investigate import data_movement as module

    tiny = ["--device", "cpu", "--models", "text_transformer", "--seq-len", "8",
            "--batch-size", "2", "--steps", "1", "--warmup", "0", "--rows", "200"]
    totals = module.main(tiny + ["--methods", "nondp", "bk_mixed"])
    out = capsys.readouterr().out
    assert "== nondp:" in out and "== bk_mixed:" in out
    assert totals["nondp"]["gram element-wise"] == 0
    assert totals["bk_mixed"]["gram element-wise"] > 0  # the certified ghost bounds' passes
    assert "private_engine/layers/gram.py" in out and "| (" in out


def test_live_memory_counts_kept_operands_and_sums(capsys):
    from bench.investigate import live_memory as module

    tiny = ["--device", "cpu", "--models", "text_transformer", "--seq-len", "8",
            "--batch-sizes", "2", "4", "--steps", "1", "--warmup", "1", "--rows", "200"]
    out = module.main(tiny + ["--methods", "nondp", "bk_mixed"])
    text = capsys.readouterr().out
    assert "== nondp" in text and "== bk_mixed" in text and "growth per sample" in text
    for method in ("nondp", "bk_mixed"):
        for n in (2, 4):
            assert out[method][n]["forward"][0] > 0  # the activations
            assert out[method][n]["step"][0] >= out[method][n]["forward"][0]
    # non-DP forms parameter gradients in its backward; bk_mixed writes its clipped sums after it
    assert any(k.startswith("bwd") for k in out["nondp"][4]["step"][1])
    assert "pe clipping/grad_sums.py:new_buffer" in text


def test_host_overhead_proxy_runs(capsys):
    from bench.investigate import host_overhead as module

    result = module.main(["--width", "32", "--steps", "1", "--repeats", "1"])
    assert result["dp_ms"] > 0 and result["nondp_ms"] > 0
    assert result["dp_ops"] > result["nondp_ops"] > 0
    assert result["dp_kernels"] > result["nondp_kernels"] > 0
    assert result["nondp_kernels"] < result["nondp_ops"]  # views and allocations are not kernels
    out = capsys.readouterr().out
    assert "aten ops/step" in out and "kernels/step" in out


def test_host_overhead_counts_kernels_at_other_shapes(capsys):
    """--count-only at a larger image and batch: counts only, more kernels than the 2-token
    proxy's (the stacked bounds form more chunks, the patch embedding more positions)."""
    from bench.investigate import host_overhead as module

    result = module.main(["--width", "32", "--img-size", "64", "--batch-size", "3",
                          "--count-only"])
    assert "dp_ms" not in result and result["dp_kernels"] > result["nondp_kernels"] > 0
    assert "kernels/step" in capsys.readouterr().out



def test_host_overhead_by_caller_ops_and_cuda_choices(capsys):
    """--by-caller with --ops names each function's operators; --cuda-choices counts torch.optim's
    multi-tensor update (fewer non-DP kernels) and puts the device-dependent constants back."""
    from bench.investigate import host_overhead as module
    from private_engine.clipping import kept
    from private_engine.layers import gram, norm_stack

    saved = (gram.ADDED_ONE_BY_ONE, gram.L1_IN_ONE_PASS, norm_stack.CPU_LAYER_ELEMENTS,
             kept.SMALL_BY_TOTAL, gram.FLOAT64_SECOND_TRY)
    args = ["--width", "32", "--count-only", "--by-caller", "3", "--ops", "2"]
    cpu = module.main(args)
    text = capsys.readouterr().out
    assert "optim/private_step.py:step  add_:" in text  # torch.optim's per-parameter loop
    cuda = module.main(args + ["--cuda-choices"])
    assert cuda["nondp_kernels"] < cpu["nondp_kernels"]
    assert (gram.ADDED_ONE_BY_ONE, gram.L1_IN_ONE_PASS, norm_stack.CPU_LAYER_ELEMENTS,
            kept.SMALL_BY_TOTAL, gram.FLOAT64_SECOND_TRY) == saved

def test_batch_flow_cost_runs(capsys):
    import torch

    from bench.investigate import batch_flow_cost as module

    threads = torch.get_num_threads()  # the proxy runs on one thread
    try:
        result = module.main(["--width", "32", "--rounds", "1", "--steps", "1", "--floor"])
    finally:
        torch.set_num_threads(threads)
    assert {"nondp", "dp", "dp_noflow", "dp_passthrough", "flow"} <= set(result)
    assert all(result[k] > 0 for k in ("nondp", "dp", "dp_noflow", "dp_passthrough"))
    assert "batch flow:" in capsys.readouterr().out


def test_float64_flops_counts_a_step_by_dtype(capsys):
    """The proxy's ghost layers form their Grams in float32: no float64 matmul FLOPs."""
    from bench.investigate import float64_flops as module

    result = module.main(["--width", "64", "--img-size", "32", "--mode", "bk", "--steps", "1"])
    assert result["gflop"]["torch.float32"] > 0
    assert result["float64_share"] == 0.0
    assert "float64 share 0.0000" in capsys.readouterr().out


def test_host_ab_runs_against_a_checkout(capsys, tmp_path):
    import torch

    from bench.investigate import host_ab as module

    # the proxy runs on one thread: restored for the tests after this one
    threads = torch.get_num_threads()
    try:
        result = module.main(["--other", str(ROOT), "--width", "32", "--rounds", "1",
                              "--steps", "1"])
        assert set(result) == {"nondp", "this", "other"} and all(b > 0 for b, _ in result.values())
        torch.set_num_threads(threads)
        result = module.main(["--other", str(ROOT), "--model", "vit_tiny_patch16_224",
                              "--img-size", "32", "--batch-size", "3", "--rounds", "2",
                              "--steps", "1"])
        assert torch.get_num_threads() == threads  # a real model runs on torch's threads
    finally:
        torch.set_num_threads(threads)
    assert set(result) == {"nondp", "this", "other"} and all(b > 0 for b, _ in result.values())
    out = capsys.readouterr().out
    assert "median per-round ratio to non-DP: this" in out and "this best" in out
    with pytest.raises(SystemExit):
        module.main(["--other", str(tmp_path), "--rounds", "1"])


def test_raised_at_names_the_innermost_private_engine_frame():
    """An out-of-memory error raised inside torch, called from the engine, is placed at the
    engine's line (what the engine was doing); with no engine frame, at the innermost frame of
    all."""
    ns: dict = {}
    exec(compile("def inner():\n"
                 "    raise RuntimeError('CUDA out of memory. Tried to allocate 3.50 MiB')\n",
                 "/site/torch/inner.py", "exec"), ns)
    exec(compile("def ours(f):\n    x = 1\n    f()\n", "/repo/private_engine/clipping.py",
                 "exec"), ns)
    with pytest.raises(RuntimeError) as info:
        ns["ours"](ns["inner"])
    assert maxbatch.raised_at(info.value) == "clipping.py:3 (ours)"
    with pytest.raises(RuntimeError) as info:
        ns["inner"]()
    assert maxbatch.raised_at(info.value) == "inner.py:2 (inner)"


def test_one_process_schedule_times_every_method_here(monkeypatch):
    """--schedule one-process: each method built and stepped in this process, one step of each
    per round, an error kept to its own row; memory still from one subprocess per method; its own
    section key and title."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cuda", "--schedule", "one-process"])
    args = cli.parse_args(["--device", "cpu", "--models", "text_transformer", "--seq-len", "8",
                           "--batch-size", "2", "--methods", "nondp", "bk_mixed", "mixed",
                           "--steps", "3", "--warmup", "1", "--schedule", "one-process",
                           "--timeout", "300"])
    assert report.section_key(args) == "text_transformer-t8-b2-cpu-float32-oneprocess"
    assert report.title(args, {"device": "CPU"}).endswith(": timed in one process")
    assert "every method timed in one process" in report.setup_lines(args, {})[0]

    order = []
    real_setup = methods.SETUPS["bk_mixed"]

    def recording(model, x, y, a):
        runner = real_setup(model, x, y, a)
        step = runner.step

        def recorded():
            order.append("bk_mixed")
            step()
        return methods.Runner(recorded, runner.describe)

    def broken(model, x, y, a):
        raise ValueError("no rule for this layer")

    monkeypatch.setitem(methods.SETUPS, "bk_mixed", recording)
    monkeypatch.setitem(methods.SETUPS, "mixed", broken)
    results = schedule.run_all(args, args.methods)
    assert results["mixed"]["error"].startswith("ValueError: no rule")
    assert "times" in results["mixed"]
    # the model's notes survive the failed setup (build_runner)
    assert results["mixed"]["trainable"] > 0
    for m in ("nondp", "bk_mixed"):
        r = results[m]
        assert "error" not in r and len(r["times"]) == 3 and r["median_s"] > 0  # warm-up dropped
        # notes from here, memory from its subprocess
        assert r["trainable"] > 0 and r["peak_delta_mib"] > 0
    assert len(order) == 4  # the warm-up and the timed steps ran in this process
    assert "ghost" in results["bk_mixed"]["note"] and results["bk_mixed"]["time_ratio"] > 0


def test_cpu_peak_memory_is_the_childs_own_not_its_parents():
    """A method's subprocess is forked from the benchmark's process; ``ru_maxrss`` keeps the
    high-water mark from before ``exec`` (the parent's RSS), so the CPU peak must come from VmHWM,
    which the meter resets."""
    import subprocess

    import torch

    ballast = torch.ones(100 * 2 ** 20)  # 400 MB held (and touched) by this, the parent, process
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch; "
            "from bench.clipping.measure import MemoryMeter; m = MemoryMeter('cpu'); "
            "m.start(); x = torch.ones(8 * 2 ** 20); "
            "print(m.exact_cpu_peak, m.delta_mib(m.peak()))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True,
                         check=True).stdout.split()
    del ballast
    if out[0] != "True":
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    assert 25 < float(out[1]) < 200  # the child's 32 MiB, not the parent's RSS


@pytest.mark.parametrize("script", ["bench_clipping.py", "investigate/host_overhead.py",
                                    "investigate/host_ab.py", "investigate/profile_step.py",
                                    "investigate/ddp_scaling.py", "bench_cpu_noise.py",
                                    "investigate/float64_flops.py",
                                    "investigate/data_movement.py",
                                    "investigate/live_memory.py",
                                    "investigate/batch_flow_cost.py"])
def test_scripts_run_from_anywhere(script, tmp_path):
    """Every script runs by its path (the Makefile's and the docs' commands), from any directory."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage:")


def test_cpu_noise_bench_runs(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cpu_noise.py"), "--sizes",
                          "2.2e6", "--rounds", "1", "--threads", "1"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert "torch normal_ (1 call)" in out and "fill_normal_ (this tree)" in out


def test_tied_lm_runs(capsys):
    from bench.investigate import tied_lm as module

    # 40 tokens at width 64: bk_mixed's memory rule ghost-norms the tied matrix (V·d > T·(d + V)),
    # bk_mixopt's time rule instantiates it (2·T²·(d + V) ≥ 32·V·d)
    result = module.main(["--vocab", "256", "--dim", "64", "--seq", "40", "--layers", "1",
                          "--batch-size", "3", "--rounds", "1"])
    assert set(result) == set(module.METHODS)
    assert result["bk_mixed"]["tied"] == "joint ghost"
    assert result["bk_mixopt"]["tied"] == "instantiated"
    assert all(r["ms"] > 0 and r["peak_mib"] >= 0 for r in result.values())
    assert "| bk_mixed | joint ghost |" in capsys.readouterr().out


def test_mae_step_runs(capsys):
    import torch

    from bench.investigate import mae_step as module

    threads = torch.get_num_threads()
    try:
        result = module.main(["--img-size", "16", "--patch-size", "8", "--depth", "1",
                              "--decoder-depth", "1", "--batch-size", "3", "--rounds", "1",
                              "--warmup", "0"])
    finally:
        torch.set_num_threads(threads)
    assert result["ratio"] > 0
    assert all(result[k]["median_ms"] > 0 for k in result if k != "ratio")
    assert capsys.readouterr().out
