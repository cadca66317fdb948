"""DPTrainer: Hugging Face's Trainer with the privacy engine, as HF users call it (a padding
collator, labels −100 at the padding, the model's default ``position_ids``)."""
from __future__ import annotations

import os

import pytest
import torch

from private_engine import BudgetExceededError
from reference import assert_close_rel, reference_clipped_sum
from tiny_lm import VOCAB, pad_collator, sample_loss, texts, tiny_gpt2

transformers = pytest.importorskip("transformers")
from private_engine.integrations.transformers import (  # noqa: E402
    DPTrainer,
    FixedBatchesWarning,
    PrivacyArguments,
)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning:opacus")]
def training_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="sgd",
                learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=1, save_strategy="no", logging_steps=1, disable_tqdm=True,
                dataloader_num_workers=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


class Recording(DPTrainer):
    """Keeps the logical batches the trainer drew."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = getattr(self, "seen", []) + [{k: v.clone() for k, v in inputs.items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def lm_collator():
    """Hugging Face's DataCollatorForLanguageModeling(mlm=False) with a word-level tokenizer
    built here (no download): padding 0, labels −100 at the padding."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[PAD]"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]")
    return transformers.DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")


@pytest.mark.parametrize("poisson,collator", [(True, "hf"), (False, "padding")],
                         ids=["poisson-DataCollatorForLanguageModeling", "fixed-padding"])
def test_one_step_is_the_clipped_mean(tmp_path, poisson, collator):
    """noise 0, SGD lr 1, constant lr: the update is −(Σ_i C_i g_i)/B over the drawn logical
    batch (physical batches of 2, accumulated), C_i from each sample's float64 gradient."""
    model = tiny_gpt2()
    data = texts(8)
    R = 1.0
    kw = dict(noise_multiplier=0.0, max_grad_norm=R, poisson_sampling=poisson)
    ctx = pytest.warns(FixedBatchesWarning) if not poisson else _nothing()
    with ctx:
        trainer = Recording(model=model, args=training_args(tmp_path), train_dataset=data,
                            data_collator=lm_collator() if collator == "hf" else pad_collator,
                            privacy_args=PrivacyArguments(**kw))
    before = [p.detach().clone() for p in model.parameters()]
    ref_model = tiny_gpt2()
    trainer.train()
    (batch,) = trainer.seen
    assert trainer.args.max_grad_norm == 0 and trainer.args.gradient_accumulation_steps == 1
    ref, norms = reference_clipped_sum(
        ref_model, [batch["input_ids"], batch["attention_mask"], batch["labels"]], sample_loss, R,
        lambda n, r: torch.clamp(r / (n + 1e-6), max=1.0))
    # the batch is drawn from the secret Poisson sampler: R below the samples' norms (≈ 2.7
    # here) makes every drawn sample's clip factor act
    assert len(norms) == 0 or float(norms.max()) > R
    B = 4  # the expected logical batch: per_device_train_batch_size · gradient_accumulation_steps
    delta = [p.detach() - b for p, b in zip(model.parameters(), before)]
    assert_close_rel(delta, [-r / B for r in ref], 1e-9)
    report = trainer.privacy_report()
    assert report.steps == 1
    assert any("epsilon" in h for h in trainer.state.log_history)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_noisy_run_reports_epsilon_within_target(tmp_path):
    model = tiny_gpt2(torch.float32)
    trainer = DPTrainer(model=model, args=training_args(tmp_path, max_steps=3),
                        train_dataset=texts(16), data_collator=pad_collator,
                        privacy_args=PrivacyArguments(target_epsilon=4.0, max_grad_norm=1.0))
    trainer.train()
    report = trainer.privacy_report()
    assert report.steps == 3 and 0 < report.epsilon <= 4.0
    assert report.delta == pytest.approx(1 / 32)
    logged = [h["epsilon"] for h in trainer.state.log_history if "epsilon" in h]
    assert logged and logged[-1] == pytest.approx(report.epsilon)


def test_peft_lora_trains_only_the_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_gpt2(torch.float32)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0,
                          fan_in_fan_out=True)
    model = peft.get_peft_model(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=training_args(tmp_path, max_steps=2),
                        train_dataset=texts(16), data_collator=pad_collator,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)
    assert trainer.privacy_report().steps == 2


def test_an_empty_first_poisson_batch_releases_noise_only(tmp_path):
    """The first batch a Poisson loader draws may be empty (likelier with several processes,
    each drawing its share): it is collated as an empty batch, not built from the data set's
    first sample (a dict of token lists), and its step updates nothing with noise 0."""
    model = tiny_gpt2()
    trainer = DPTrainer(model=model, args=training_args(tmp_path), train_dataset=texts(8),
                        data_collator=pad_collator,
                        privacy_args=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=1.0))
    empty = trainer.get_train_dataloader().collate_fn([])
    trainer.create_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    loss = trainer.training_step(model, empty)
    assert float(loss) == 0.0 and trainer.privacy_engine.steps_taken == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_checkpoints_hold_the_engine_and_resume(tmp_path):
    args = training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    privacy = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = DPTrainer(model=tiny_gpt2(torch.float32), args=args, train_dataset=texts(16),
                        data_collator=pad_collator, privacy_args=privacy)
    trainer.train()
    assert os.path.exists(tmp_path / "checkpoint-1" / "private_engine.pt")
    assert os.path.exists(tmp_path / "private_engine.ledger")
    eps = trainer.privacy_report().epsilon
    # resumed from the first checkpoint: the ledger holds both steps the run released, so the
    # planned budget (2 steps) is spent and the resumed run's step is refused
    again = DPTrainer(model=tiny_gpt2(torch.float32), args=args, train_dataset=texts(16),
                      data_collator=pad_collator, privacy_args=privacy)
    with pytest.raises(BudgetExceededError):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    report = again.privacy_report()
    assert report.steps == 2 and report.epsilon == pytest.approx(eps)


def test_a_run_killed_before_its_first_checkpoint_counts_its_steps(tmp_path):
    """The ledger is opened before the first step: a run started again into the same output_dir
    (no checkpoint to resume from) starts with the released steps spent."""
    args = training_args(tmp_path, max_steps=2)
    privacy = PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0)
    first = DPTrainer(model=tiny_gpt2(torch.float32), args=args, train_dataset=texts(16),
                      data_collator=pad_collator, privacy_args=privacy)
    first.train()
    assert first.privacy_report().steps == 2
    again = DPTrainer(model=tiny_gpt2(torch.float32), args=args, train_dataset=texts(16),
                      data_collator=pad_collator, privacy_args=privacy)
    with pytest.raises(BudgetExceededError):
        again.train()
    assert again.privacy_report().steps == 2
