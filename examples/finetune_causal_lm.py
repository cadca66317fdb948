#!/usr/bin/env python
"""Private fine-tuning of a causal language model with Hugging Face's ``Trainer``
(``private_engine.integrations.transformers.DPTrainer``).

By default nothing is downloaded: a small GPT-2-style model (random configuration) is trained on
generated sentences ("the small cat sees a red bird.") with a character-level vocabulary. Each
example is one sentence; a padding collator builds ``attention_mask`` and ``labels`` (−100 at the
padding), and the model is called as Hugging Face users call it (default ``position_ids``). The
logical batch (``--batch-size``) is drawn by Poisson sampling and processed in physical batches of
``--physical-batch-size``; each sample's loss is the mean over its own tokens, its gradient is
clipped to ``--max-grad-norm``, and the noise is calibrated to ``--epsilon`` at δ = 1/(2n). The
Trainer's progress bar and logs show ε; the last line reads ``ε=… δ=… loss=…`` (the held-out
per-sample mean token loss).

``--model NAME --pretrained`` loads a real checkpoint and its tokenizer from the Hugging Face hub
(network needed; only when asked). ``--lora`` trains LoRA adapters (peft) instead of every
parameter.

Examples::

    python examples/finetune_causal_lm.py                       # about 5 minutes on 2 CPU cores
    python examples/finetune_causal_lm.py --lora --epsilon 3
    python examples/finetune_causal_lm.py --model gpt2 --pretrained --lora --max-steps 50
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import warnings
from typing import Dict, List, Optional, Sequence

import torch

NOUNS = ["cat", "dog", "bird", "fox", "child", "farmer", "horse", "teacher", "robot", "sailor"]
ADJECTIVES = ["small", "red", "quick", "old", "happy", "tired", "green", "quiet", "brave"]
VERBS = ["sees", "likes", "follows", "finds", "helps", "calls", "watches", "meets"]
PLACES = ["in the park", "at home", "by the river", "near the school", "on the hill", ""]


def generate_sentences(n: int, seed: int = 0) -> List[str]:
    """``n`` sentences of a small public grammar: ``the ADJ NOUN VERB a ADJ NOUN [PLACE].``"""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        place = rng.choice(PLACES)
        out.append(f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(VERBS)} a "
                   f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}{' ' + place if place else ''}.")
    return out


class CharTokenizer:
    """Characters of the grammar's words as tokens; id 0 is the padding (and start) token."""

    def __init__(self, texts: Sequence[str]):
        self.chars = sorted({c for t in texts for c in t})
        self.ids = {c: i + 1 for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> List[int]:
        return [0] + [self.ids[c] for c in text]


def pad_collator(features: List[Dict[str, List[int]]], pad_id: int = 0) -> Dict[str, torch.Tensor]:
    """Right padding to the longest example: ``input_ids``, ``attention_mask`` and ``labels`` (the
    ids, −100 at the padding)."""
    T = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(features), T, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build(args):
    """``(model, examples, collator)``: a random GPT-2-style model on the generated sentences, or
    (``--pretrained``) the hub checkpoint ``--model`` with its tokenizer."""
    import transformers

    texts = generate_sentences(args.samples + args.eval_samples, seed=args.seed)
    if args.pretrained:
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
        examples = [{"input_ids": tok(t)["input_ids"][:args.seq_len]} for t in texts]
        pad = tok.pad_token_id
    else:
        tok = CharTokenizer(texts)
        cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=args.seq_len,
                                      n_embd=args.n_embd, n_layer=args.n_layer,
                                      n_head=args.n_head, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
        torch.manual_seed(args.seed)
        model = transformers.GPT2LMHeadModel(cfg)
        examples = [{"input_ids": tok.encode(t)[:args.seq_len]} for t in texts]
        pad = 0
    if args.lora:
        import peft

        targets = ["c_attn"] if not args.pretrained else None
        cfg = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                              target_modules=targets, fan_in_fan_out=not args.pretrained,
                              task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, cfg)
    return model, examples, (lambda f: pad_collator(f, pad))


@torch.no_grad()
def held_out_loss(model, examples, collator, batch_size: int = 64) -> float:
    """Mean over the held-out examples of each one's mean next-token loss."""
    from private_engine.integrations.losses import token_mean_loss

    was = model.training
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(examples), batch_size):
        batch = collator(examples[s:s + batch_size])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total += float(token_mean_loss(logits, batch["labels"], shift=True).sum())
        n += batch["input_ids"].shape[0]
    model.train(was)
    return total / max(n, 1)


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2",
                   help="hub name, loaded only with --pretrained (default: a random GPT-2-style "
                        "configuration)")
    p.add_argument("--pretrained", action="store_true", help="download --model's weights")
    p.add_argument("--lora", action="store_true", help="train peft LoRA adapters only")
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--samples", type=int, default=2000, help="training sentences (n)")
    p.add_argument("--eval-samples", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--max-steps", type=int, default=-1, help="steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=128, help="expected logical batch B")
    p.add_argument("--physical-batch-size", type=int, default=64)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the sentences and the initialisation (never the noise or batches)")
    p.add_argument("--output-dir", default=None, help="Trainer output (default: a temp folder)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.batch_size % args.physical_batch_size:
        p.error("--batch-size must be a multiple of --physical-batch-size")
    return args


def main(argv: Optional[Sequence[str]] = None) -> float:
    args = parse(argv)
    import transformers

    from private_engine.integrations.transformers import DPTrainer, PrivacyArguments

    model, examples, collator = build(args)
    train, held_out = examples[:args.samples], examples[args.samples:]
    with tempfile.TemporaryDirectory() as tmp:
        training_args = transformers.TrainingArguments(
            output_dir=args.output_dir or tmp, use_cpu=not torch.cuda.is_available(),
            report_to=[], save_strategy="no", optim="adamw_torch", learning_rate=args.lr,
            lr_scheduler_type="constant", weight_decay=0.0, num_train_epochs=args.epochs,
            max_steps=args.max_steps, per_device_train_batch_size=args.physical_batch_size,
            gradient_accumulation_steps=args.batch_size // args.physical_batch_size,
            logging_steps=5, disable_tqdm=args.quiet, seed=args.seed)
        privacy = PrivacyArguments(target_epsilon=args.epsilon, max_grad_norm=args.max_grad_norm)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Secure RNG turned off")
            trainer = DPTrainer(model=model, args=training_args, train_dataset=train,
                                data_collator=collator, privacy_args=privacy)
            trainer.train()
    report = trainer.privacy_report()
    loss = held_out_loss(model, held_out, collator)
    print(f"ε={report.epsilon:.3f} δ={report.delta:.3g} loss={loss:.4f}")
    return loss


if __name__ == "__main__":
    main(sys.argv[1:])
