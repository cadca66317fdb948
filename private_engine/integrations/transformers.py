"""Differentially private fine-tuning with Hugging Face's ``Trainer``.

::

    from private_engine.integrations.transformers import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                        data_collator=collator,
                        privacy_args=PrivacyArguments(target_epsilon=3.0, max_grad_norm=1.0))
    trainer.train()
    print(trainer.privacy_report())

:class:`DPTrainer` is a ``transformers.Trainer`` whose training step is the engine's private step
(:class:`private_engine.PrivacyEngine`): each logical batch is a Poisson sample of the training
set at rate ``q = B/n`` (``B = per_device_train_batch_size · gradient_accumulation_steps · W``,
W the number of processes), processed in physical batches of ``per_device_train_batch_size``
whose per-sample losses are clipped and accumulated, then released once with Gaussian noise.
Under ``torchrun`` (W > 1) each rank draws its share of the Poisson batch and clips it; the
engine, built on the bare model (no ``DistributedDataParallel``), sums the ranks' clipped
gradients and adds the noise once. The per-sample loss is computed
from the model's logits and the batch's labels (:mod:`private_engine.integrations.losses`: a
causal language model's loss of sample i is the mean over sample i's own labelled tokens). The
Trainer's own gradient clipping is off (the engine clips per sample), ε is logged with the
Trainer's logs, and the engine's state is written with every Trainer checkpoint and restored on
``train(resume_from_checkpoint=...)`` (docs/transformers.md).
"""
from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader

from ..accounting import PrivacyReport
from ..checkpoint import atomic_save, load_engine_state_dict, use_ledger
from ..engine import PrivacyEngine
from .logical_batches import batch_rows, logical_batch_loader, physical_batches
from .losses import per_sample_loss

#: the engine's state inside each Trainer checkpoint folder, and its step ledger in output_dir
ENGINE_STATE_NAME = "private_engine.pt"
LEDGER_NAME = "private_engine.ledger"


class FixedBatchesWarning(UserWarning):
    """``poisson_sampling=False``: the reported ε assumes Poisson sampling, which the batches do
    not follow."""


@dataclass
class PrivacyArguments:
    """The privacy parameters of a :class:`DPTrainer` run.

    Args:
        target_epsilon: ε to reach at the end of training (σ is calibrated from it, the number
            of steps and q); or give ``noise_multiplier``.
        noise_multiplier: σ (the noise's standard deviation is σ·R).
        max_grad_norm: R, the per-sample clipping threshold.
        target_delta: δ; None gives ``1 / (2n)`` for a training set of n examples.
        poisson_sampling: logical batches drawn by Poisson sampling at rate ``q = B/n`` (what
            the accountant assumes). False: shuffled batches of exactly B, with a warning that
            the reported ε is then not a guarantee for them.
        clipping_mode: the engine's clipping mode (``"bk_mixed"``, ``"bk"``, ``"mixed"``, …).
        clipping_fn: ``"abadi"``, ``"automatic"`` or ``"global"``.
        accountant: ``"rdp"``, ``"prv"`` or ``"gdp"``.
        secure_mode: noise from the OS cryptographic generator (slower).
    """

    target_epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    max_grad_norm: float = 1.0
    target_delta: Optional[float] = None
    poisson_sampling: bool = True
    clipping_mode: str = "bk_mixed"
    clipping_fn: str = "abadi"
    accountant: str = "rdp"
    secure_mode: bool = False

    def __post_init__(self):
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("PrivacyArguments: give exactly one of target_epsilon or "
                             "noise_multiplier.")
        if not (isinstance(self.max_grad_norm, (int, float)) and 0 < self.max_grad_norm < math.inf):
            raise ValueError(f"PrivacyArguments: max_grad_norm must be a finite number > 0, got "
                             f"{self.max_grad_norm!r}.")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (or the base model of a peft wrapper) is a causal language model, whose
    token t predicts label t+1: its class is one of transformers' causal-LM classes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if getattr(base, "loss_type", None) == "ForCausalLM" or name.endswith("ForCausalLM"):
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _released_in_training_step(*args, **kwargs):
    """The Trainer's ``optimizer.step()``: the private step was already taken by
    :meth:`DPTrainer.training_step` (clip, noise once, update), so nothing is left to do."""
    return None


class DPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with differential privacy (module docstring).

    Takes the Trainer's arguments plus ``privacy_args`` (:class:`PrivacyArguments`).
    ``TrainingArguments`` map as follows: ``per_device_train_batch_size`` is the physical batch
    (the most samples in one forward), ``per_device_train_batch_size ·
    gradient_accumulation_steps · world_size`` the expected logical batch B (one private step,
    one noise draw; what the accountant counts, ``q = B/n``); the Trainer itself then runs one
    batch per step (its ``gradient_accumulation_steps`` is set to 1). ``max_grad_norm`` of
    ``TrainingArguments`` is set to 0: clipping is the engine's, per sample, at
    ``privacy_args.max_grad_norm``. Training length (``num_train_epochs`` or ``max_steps``) is
    the length σ is calibrated for. float16 (``fp16=True``) is refused: use ``bf16=True`` or
    float32.

    Data-parallel (``torchrun``, ``world_size`` W > 1; NCCL on GPUs, gloo on CPUs): the engine
    is built on the bare model under the process group (the Trainer's
    ``DistributedDataParallel`` wrapping is skipped: it would all-reduce unclipped gradients);
    each rank draws each index of its shard of the training set with probability q (about B/W
    samples a step, the union of the ranks' batches being Poisson at rate q) and clips its
    samples; the engine sums the ranks' clipped sums and rank 0 adds the noise, once, so every
    rank applies the same update (docs/distributed.md). Rank 0 writes the engine's state with
    the Trainer's checkpoint and records the step ledger. DeepSpeed, FSDP and
    ``poisson_sampling=False`` are refused with several processes.

    ``per_sample_loss(model, inputs) -> (B,)`` may be given (or overridden) for a loss other than
    the model's own, computed from ``logits`` and ``labels``
    (:func:`private_engine.integrations.losses.per_sample_loss`).
    """

    def __init__(self, *args, privacy_args: Optional[PrivacyArguments] = None,
                 per_sample_loss: Optional[Callable[[nn.Module, Dict[str, Any]],
                                                    torch.Tensor]] = None, **kwargs):
        if privacy_args is None:
            raise TypeError("DPTrainer needs privacy_args=PrivacyArguments(target_epsilon=... or "
                            "noise_multiplier=..., max_grad_norm=...).")
        training_args = kwargs.pop("args", None) if "args" in kwargs else (
            args[1] if len(args) > 1 else None)
        if training_args is None:
            raise TypeError("DPTrainer needs args=TrainingArguments(...) (the physical batch "
                            "size, the training length and the optimizer).")
        self.privacy_args = privacy_args
        if training_args.fp16:
            raise ValueError("DPTrainer: fp16=True is not supported (the Trainer's GradScaler "
                             "scales a batch-mean loss); use bf16=True or float32.")
        #: W, the data-parallel processes (torchrun's WORLD_SIZE; 1 in one process)
        self.world_size = int(training_args.world_size)
        if self.world_size > 1:
            _check_data_parallel(training_args, privacy_args)
        self.physical_batch_size = int(training_args.per_device_train_batch_size)
        self.logical_batch_size = self.physical_batch_size * int(
            training_args.gradient_accumulation_steps) * self.world_size
        training_args = copy.copy(training_args)
        training_args.gradient_accumulation_steps = 1  # one Poisson logical batch per step
        training_args.max_grad_norm = 0.0  # the engine clips per sample
        # the engine reduces the ranks' clipped sums itself; the loss's token count is unused
        training_args.average_tokens_across_devices = False
        if len(args) > 1:
            args = (args[0], training_args, *args[2:])
        else:
            kwargs["args"] = training_args
        super().__init__(*args, **kwargs)
        self._per_sample_loss = per_sample_loss
        #: the privacy engine (built with the optimizer, when training starts)
        self.privacy_engine: Optional[PrivacyEngine] = None
        self._private_step: Optional[Callable] = None
        self._causal = is_causal_lm(self.model)
        if not privacy_args.poisson_sampling:
            warnings.warn(
                "DPTrainer(poisson_sampling=False): batches of exactly "
                f"{self.logical_batch_size} shuffled samples. The reported ε is computed for "
                "Poisson sampling at the same rate q = B/n, which these batches do not follow: "
                "it is not a guarantee for this run (sampling without replacement gives other, "
                "weaker amplification). Keep poisson_sampling=True for the reported ε to hold.",
                FixedBatchesWarning, stacklevel=2)

    # -- data -------------------------------------------------------------------------------
    def _train_data(self):
        """The training set and collator, with the columns the model does not take removed (as
        the Trainer does)."""
        dataset, collator = self.train_dataset, self.data_collator
        if dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset.")
        try:
            import datasets

            is_hf = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf = False
        if is_hf:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return dataset, collator

    def get_train_dataloader(self) -> DataLoader:
        """Logical batches: Poisson samples at rate ``q = B/n`` from an entropy-seeded generator,
        or — ``poisson_sampling=False`` — shuffled batches of exactly B
        (:func:`~private_engine.integrations.logical_batches.logical_batch_loader`). An empty
        Poisson batch's step releases noise only. Under torchrun each rank draws its own share:
        each index of its shard of the data set with probability q, the union of the ranks'
        batches being the Poisson logical batch. The loader is used as built (the Trainer's
        ``accelerator.prepare`` never re-shards or re-batches it)."""
        dataset, collator = self._train_data()
        B = self.logical_batch_size
        if B > len(dataset):
            raise ValueError(f"DPTrainer: the logical batch ({B} = per_device_train_batch_size · "
                             f"gradient_accumulation_steps) exceeds the {len(dataset)} training "
                             "examples.")
        return logical_batch_loader(dataset, B, collator,
                                    poisson=self.privacy_args.poisson_sampling,
                                    distributed=self.world_size > 1,
                                    num_workers=self.args.dataloader_num_workers)

    # -- the engine -------------------------------------------------------------------------
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, privatised by the engine built here on the model."""
        optimizer = super().create_optimizer(model)
        if self.privacy_engine is None:
            self._build_engine(optimizer)
        return optimizer

    def _build_engine(self, optimizer: torch.optim.Optimizer) -> None:
        pa, args = self.privacy_args, self.args
        dataset, _ = self._train_data()
        length = (dict(steps=int(args.max_steps)) if args.max_steps and args.max_steps > 0
                  else dict(epochs=float(args.num_train_epochs)))
        self.privacy_engine = PrivacyEngine(
            self.model, batch_size=self.logical_batch_size, sample_size=len(dataset),
            max_grad_norm=float(pa.max_grad_norm), noise_multiplier=pa.noise_multiplier,
            target_epsilon=pa.target_epsilon, target_delta=pa.target_delta,
            clipping_mode=pa.clipping_mode, clipping_fn=pa.clipping_fn,
            accountant=pa.accountant, secure_mode=pa.secure_mode,
            check_sampling=bool(pa.poisson_sampling), distributed=self.world_size > 1, **length)
        # every step is recorded before its release from the first one on: a run killed before
        # its first checkpoint and started again into the same output_dir counts what it spent
        use_ledger(self.privacy_engine, os.path.join(args.output_dir, LEDGER_NAME))
        self.privacy_engine.attach(optimizer)
        # the private step runs inside training_step; the Trainer's optimizer.step() is empty
        self._private_step = optimizer.step
        optimizer.step = _released_in_training_step

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The Trainer's preparation, the model left unwrapped under torchrun: accelerate would
        wrap it in ``DistributedDataParallel``, whose reducer all-reduces the raw gradients; the
        engine, built on the bare module, reduces the ranks' clipped sums itself. The model gets
        accelerate's mixed precision only (``evaluation_mode=True``), no device placement: the
        Trainer placed it on ``args.device`` before the engine was built on its parameters."""
        if self.world_size <= 1:
            return super()._prepare_for_training(max_steps, train_dataloader,
                                                 resume_from_checkpoint)
        accelerator = self.accelerator
        prepare_model = accelerator.prepare_model

        def without_ddp(model, device_placement=None, evaluation_mode=False):
            return prepare_model(model, device_placement=False, evaluation_mode=True)

        accelerator.prepare_model = without_ddp
        try:
            model, loader = super()._prepare_for_training(max_steps, train_dataloader,
                                                          resume_from_checkpoint)
        finally:
            del accelerator.prepare_model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise RuntimeError("DPTrainer: the Trainer wrapped the model in "
                               "DistributedDataParallel, which would all-reduce unclipped "
                               "gradients; the engine reduces the clipped sums itself.")
        return model, loader

    def privacy_report(self) -> PrivacyReport:
        """The engine's :class:`private_engine.accounting.PrivacyReport` (ε spent, δ, σ, q,
        steps, the budget); ``str()`` gives one line."""
        if self.privacy_engine is None:
            raise RuntimeError("DPTrainer.privacy_report(): no private step yet (call train()).")
        return self.privacy_engine.privacy_report()

    # -- the step ---------------------------------------------------------------------------
    def compute_per_sample_loss(self, model: nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
        """``(B,)`` losses of one physical batch: ``per_sample_loss(model, inputs)`` when given,
        else the model run without its labels and
        :func:`private_engine.integrations.losses.per_sample_loss` on its logits (a causal LM's
        labels shifted by one)."""
        if self._per_sample_loss is not None:
            return self._per_sample_loss(model, inputs)
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("DPTrainer: the batch has no 'labels' (for a causal LM, use "
                             "DataCollatorForLanguageModeling(tokenizer, mlm=False)), or pass "
                             "per_sample_loss=.")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        return per_sample_loss(logits, labels, causal=self._causal)

    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One private step on a logical batch: each physical batch's per-sample losses are
        clipped and accumulated (``virtual_step``), the last one releases the noisy sum and
        updates the parameters. An empty (Poisson) batch releases noise only. Returns the
        batch's mean per-sample loss (detached)."""
        model.train()
        device = self.args.device
        if not isinstance(inputs, Mapping) or batch_rows(inputs) == 0:
            self._private_step(loss=torch.zeros(0, device=device))
            return torch.zeros((), device=device)
        inputs = self._prepare_inputs(inputs)
        chunks = physical_batches(inputs, self.physical_batch_size)
        total, count = torch.zeros((), device=device), 0
        optimizer = self.privacy_engine_optimizer
        for k, chunk in enumerate(chunks):
            with self.compute_loss_context_manager():
                losses = self.compute_per_sample_loss(model, chunk)
            total = total + losses.detach().float().sum()
            count += losses.shape[0]
            if k + 1 < len(chunks):
                optimizer.virtual_step(loss=losses)
            else:
                self._private_step(loss=losses)
        return total / max(count, 1)

    @property
    def privacy_engine_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the engine is attached to (the Trainer may wrap it)."""
        opt = self.optimizer
        while not hasattr(opt, "virtual_step") and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt

    # -- logs and checkpoints ---------------------------------------------------------------
    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        """The Trainer's log, with ε spent so far (at the engine's δ) added to training logs."""
        if self.privacy_engine is not None:
            logs["epsilon"] = self.privacy_engine.get_epsilon()
        super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, with the engine's state (public values only:
        :func:`private_engine.checkpoint.engine_state_dict`) in ``private_engine.pt``; every step
        is recorded before its release in the step ledger ``output_dir/private_engine.ledger``
        (opened when the engine is built, before the first step)."""
        super()._save_checkpoint(model, trial)
        engine = self.privacy_engine
        if engine is None:
            return
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-"
                                       f"{self.state.global_step}")
        if engine.ledger is None:
            use_ledger(engine, os.path.join(run_dir, LEDGER_NAME))  # every rank (rank 0 writes)
        if self.args.should_save:  # the process that writes the Trainer's checkpoint
            atomic_save(engine.state_dict(), os.path.join(folder, ENGINE_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """The Trainer's resume, then the engine's state: the accountant takes the step ledger's
        history (every step released since, too); a checkpoint of other privacy parameters is
        refused (:func:`private_engine.checkpoint.load_engine_state_dict`)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.privacy_engine is None:
            return
        path = os.path.join(checkpoint, ENGINE_STATE_NAME)
        if not os.path.exists(path):
            raise ValueError(f"DPTrainer: {checkpoint!r} holds no engine state "
                             f"({ENGINE_STATE_NAME}): it was not written by a DPTrainer, and "
                             "resuming from it would forget the privacy spent.")
        state = torch.load(path, map_location="cpu", weights_only=True)
        load_engine_state_dict(self.privacy_engine, state,
                               near=os.path.dirname(os.path.abspath(checkpoint)))


def _check_data_parallel(args, privacy_args: PrivacyArguments) -> None:
    """Refuse what DPTrainer cannot run data-parallel: DeepSpeed and FSDP (they wrap or shard the
    model the engine clips), and fixed batches (each rank would shuffle on its own)."""
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError("DPTrainer runs data-parallel over torch.distributed (torchrun) only: "
                         "DeepSpeed and FSDP are not supported. Remove deepspeed=/fsdp= from "
                         "TrainingArguments.")
    if not privacy_args.poisson_sampling:
        raise ValueError("DPTrainer: poisson_sampling=False is not supported with several "
                         "processes (each rank draws its share of a Poisson batch); keep "
                         "poisson_sampling=True.")

