"""examples/finetune_causal_lm.py: DPTrainer on generated text with a random GPT-2-style model
(tiny sizes; nothing is downloaded)."""
import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
FINAL = re.compile(r"^ε=([0-9.]+) δ=([0-9.e+-]+) loss=([0-9.]+)$")
TINY = ["--samples", "48", "--eval-samples", "8", "--batch-size", "8",
        "--physical-batch-size", "4", "--max-steps", "2", "--n-embd", "16", "--n-layer", "1",
        "--n-head", "2", "--seq-len", "48", "--quiet", "--epsilon", "4"]


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_causal_lm",
                                                  ROOT / "examples" / "finetune_causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_and_reports_epsilon(capsys, tmp_path):
    """Full fine-tuning (LoRA through DPTrainer: tests/integrations/test_dp_trainer.py)."""
    example = load_example()
    loss = example.main(TINY + ["--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    m = FINAL.match(out.strip().splitlines()[-1])
    assert m, out[-500:]
    eps, delta, final_loss = map(float, m.groups())
    assert 0 < eps <= 4.0 and delta == pytest.approx(1 / 96, rel=1e-2)
    assert final_loss == pytest.approx(loss, abs=1e-4)
    assert "'epsilon'" in out  # the Trainer's logs carry ε


def test_pretrained_weights_are_loaded_only_when_asked(monkeypatch):
    """Without --pretrained the hub is never called; with it, --model's weights are asked for."""
    import transformers

    example = load_example()
    calls = []

    def refuse(name, *a, **k):
        calls.append(name)
        raise RuntimeError("no network in tests")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    model, examples, _ = example.build(example.parse(TINY))
    assert not calls and type(model).__name__ == "GPT2LMHeadModel" and len(examples) == 56
    with pytest.raises(RuntimeError, match="no network"):
        example.build(example.parse(TINY + ["--model", "sshleifer/tiny-gpt2", "--pretrained"]))
    assert calls == ["sshleifer/tiny-gpt2"]
