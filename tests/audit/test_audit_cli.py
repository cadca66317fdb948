"""``private-engine audit`` and examples/privacy_audit.py run with tiny sizes and print what
they promise."""
import importlib.util
import re
from pathlib import Path

import pytest

from private_engine.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_cli_audit_prints_one_summary_line_and_plots(capsys, tmp_path):
    plot = tmp_path / "scores.png"
    # 60 canaries certify at most ≈ 2.3 (the ceiling), so a claim of 4 cannot be refuted
    code = main(["audit", "--canaries", "60", "--steps", "3", "--data-size", "40",
                 "--epsilon", "4", "--plot", str(plot)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert re.match(r"consistent: ε_lower=[0-9.]+ claimed ε=[0-9.]+ δ=1e-05 \(95% confidence; "
                    r"\d+/\d+ correct guesses", out[0]), out
    assert plot.stat().st_size > 0


def test_cli_audit_control_exit_status_says_whether_it_was_flagged(capsys):
    code = main(["audit", "--canaries", "400", "--steps", "8", "--data-size", "40",
                 "--epsilon", "1", "--control", "noise_scaled", "--score", "sum"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("VIOLATION"), out


def test_example_sweep_prints_a_table_and_saves_the_plot(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("privacy_audit_example",
                                                  ROOT / "examples" / "privacy_audit.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    plot = tmp_path / "sweep.png"
    example.main(["--canaries", "300", "--data-size", "50", "--steps", "6", "--epsilons", "1",
                  "--delta", "1e-5", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "claimed ε" in out and "noise_scaled×100" in out and "consistent" in out
    assert plot.stat().st_size > 0


def test_cli_audit_paths_door_and_mode_print_a_line_per_path(capsys):
    code = main(["audit", "--canaries", "90", "--steps", "3", "--data-size", "10", "--epsilon",
                 "4", "--paths", "traced,conv", "--door", "opacus"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[0].startswith("consistent: ") and "2 paths" in out[0], out
    assert "door=opacus" in out[0]
    assert [line.split()[0] for line in out[2:4]] == ["conv", "traced"], out
    code = main(["audit", "--canaries", "40", "--steps", "2", "--data-size", "10", "--epsilon",
                 "4", "--paths", "linear", "--clipping-mode", "ghost"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == 1 and "mode=ghost" in out[0], out
    with pytest.raises(SystemExit):
        main(["audit", "--paths", "linear,attention"])


def test_example_audits_every_path_when_asked(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("privacy_audit_example",
                                                  ROOT / "examples" / "privacy_audit.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--canaries", "90", "--data-size", "10", "--steps", "3", "--epsilons", "2",
                  "--delta", "1e-5", "--paths", "all", "--door", "opacus",
                  "--plot", str(tmp_path / "sweep.png")])
    out = capsys.readouterr().out
    assert "each path's canaries alone" in out and "groupnorm" in out and "fallback" in out
