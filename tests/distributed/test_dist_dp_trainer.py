"""DPTrainer data-parallel, world size 2 (gloo, CPU), as torchrun runs it: each rank builds its
``TrainingArguments`` from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) under
the initialised process group.

* noise 0, SGD lr 1, one step: the update is −(Σ_i C_i g_i)/B over the union of both ranks'
  secret Poisson batches (each rank records what it drew), C_i from each sample's float64
  gradient, B = per_device_train_batch_size · gradient_accumulation_steps · world_size; both
  ranks end with identical parameters; the model is not wrapped in DistributedDataParallel.
* ε is logged, the checkpoint holds the engine's state, the step ledger records the step.
* A noisy run stopped after its checkpoint and resumed from it on both ranks counts every step
  and keeps identical replicas.
* Fixed batches (``poisson_sampling=False``) are refused with several processes.
"""
from __future__ import annotations

import os

import pytest
import torch

from dist_spawn import run_ranks
from tiny_lm import pad_collator, sample_loss, texts, tiny_gpt2

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
R = 1.0


def _one_step(rank, out_dir):
    from private_engine.integrations.transformers import (
        ENGINE_STATE_NAME,
        LEDGER_NAME,
        DPTrainer,
        PrivacyArguments,
    )

    class Recording(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen = getattr(self, "seen", []) + [{k: v.clone() for k, v in inputs.items()}]
            return super().training_step(model, inputs, num_items_in_batch)

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2")
    args = transformers.TrainingArguments(
        output_dir=out_dir, use_cpu=True, report_to=[], optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        save_strategy="steps", save_steps=1, logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0)
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Recording(model=model, args=args, train_dataset=texts(12),
                        data_collator=pad_collator,
                        privacy_args=PrivacyArguments(noise_multiplier=0.0, max_grad_norm=R))
    trainer.train()
    (batch,) = trainer.seen
    state = torch.load(os.path.join(out_dir, "checkpoint-1", ENGINE_STATE_NAME),
                       weights_only=True)
    resumed = _stop_and_resume(os.path.join(out_dir, "resume"), DPTrainer, PrivacyArguments)
    try:  # each rank would shuffle its own fixed batches: refused
        DPTrainer(model=tiny_gpt2(), args=args, train_dataset=texts(12),
                  data_collator=pad_collator,
                  privacy_args=PrivacyArguments(noise_multiplier=0.0, poisson_sampling=False))
        fixed_refused = False
    except ValueError as e:
        fixed_refused = "poisson_sampling" in str(e)
    return dict(world_size=trainer.args.world_size, batch=batch, before=before,
                fixed_refused=fixed_refused, resumed=resumed,
                after=[p.detach().clone() for p in model.parameters()],
                wrapped=type(trainer.model_wrapped).__name__,
                logical_batch_size=trainer.logical_batch_size,
                steps=trainer.privacy_report().steps,
                logged_epsilon=any("epsilon" in h for h in trainer.state.log_history),
                state_steps=len(state["accountant"]["history"]),
                ledger=os.path.exists(os.path.join(out_dir, LEDGER_NAME)))


def _stop_and_resume(out_dir, DPTrainer, PrivacyArguments):
    """A noisy run of 6 steps stopped after its checkpoint at step 3, then resumed from it
    (about one sample per rank and step: some ranks' batches are empty)."""

    class StopAt3(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    args = transformers.TrainingArguments(
        output_dir=out_dir, use_cpu=True, report_to=[], optim="sgd", learning_rate=0.1,
        per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=6,
        save_strategy="steps", save_steps=3, logging_steps=1, disable_tqdm=True)
    privacy = PrivacyArguments(target_epsilon=8.0, max_grad_norm=R)
    steps = []
    for resume, callbacks in ((None, [StopAt3()]), (os.path.join(out_dir, "checkpoint-3"), [])):
        trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=texts(12),
                            data_collator=pad_collator, privacy_args=privacy,
                            callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        steps.append(trainer.privacy_report().steps)
    return dict(steps=steps, epsilon=trainer.privacy_report().epsilon,
                params=[p.detach().clone() for p in trainer.model.parameters()])


def test_one_data_parallel_step_is_the_clipped_mean_over_both_ranks(tmp_path):
    from reference import assert_close_rel, reference_clipped_sum

    r0, r1 = run_ranks(_one_step, tmp_path, timeout=300.0)
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["wrapped"] == r1["wrapped"] == "GPT2LMHeadModel"  # no DistributedDataParallel
    B = 2 * 2 * 2  # per_device_train_batch_size · gradient_accumulation_steps · world_size
    assert r0["logical_batch_size"] == r1["logical_batch_size"] == B
    for a, b in zip(r0["after"], r1["after"]):
        assert torch.equal(a, b)  # the replicas stay identical
    for a, b in zip(r0["before"], r1["before"]):
        assert torch.equal(a, b)
    ref = [torch.zeros_like(p) for p in r0["before"]]
    norms = []
    for r in (r0, r1):  # each rank's secret share of the Poisson batch, as it recorded it
        batch = r["batch"]
        if batch["input_ids"].shape[0] == 0:
            continue
        part, n = reference_clipped_sum(
            tiny_gpt2(), [batch["input_ids"], batch["attention_mask"], batch["labels"]],
            sample_loss, R, lambda n, r: torch.clamp(r / (n + 1e-6), max=1.0))
        ref = [t + p for t, p in zip(ref, part)]
        norms.append(n)
    # every drawn sample's clip factor acts (norms ≈ 2.7 > R)
    assert all(float(n.max()) > R for n in norms)
    delta = [a - b for a, b in zip(r0["after"], r0["before"])]
    assert_close_rel(delta, [-t / B for t in ref], 1e-9)
    assert r0["steps"] == r1["steps"] == 1 and r0["logged_epsilon"]
    assert r0["state_steps"] == 1 and r0["ledger"]
    assert r0["fixed_refused"] and r1["fixed_refused"]
    a, b = r0["resumed"], r1["resumed"]  # stopped at 3 of 6 steps, resumed on every rank
    assert a["steps"] == b["steps"] == [3, 6] and a["epsilon"] == b["epsilon"] <= 8.0
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
