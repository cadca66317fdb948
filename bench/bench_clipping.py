#!/usr/bin/env python
"""Seconds per step, peak memory and maximum batch size of non-private training, private_engine and Opacus, in one run.

Every method trains the same model (same initialisation, all parameters trainable unless its name
ends in ``_frozen``) on the same random batch with SGD and cross-entropy. One step is forward +
per-sample clipping + noise + optimizer step (forward + backward + step for non-private training)::

    nondp                plain training (the reference for every ratio)
    mixed                private_engine, clipping_mode="mixed" (ghost or instantiate per layer; norm pass + 2nd backward)
    ghost                private_engine, clipping_mode="ghost"
    per_sample           private_engine, clipping_mode="per_sample"
    bk                   private_engine, clipping_mode="bk" (book-keeping, one backward; ghost norm wherever possible)
    bk_mixed             private_engine, clipping_mode="bk_mixed" (book-keeping; seed 002's memory rule per layer)
    bk_mixopt            private_engine, clipping_mode="bk_mixopt" (book-keeping; time-priority rule per layer)
    opacus_hooks         Opacus make_private(grad_sample_mode="hooks")  (per-sample gradients)
    opacus_ghost         Opacus make_private(grad_sample_mode="ghost")  (ghost clipping)
    dropin_hooks         the Opacus loop of opacus_hooks with ``from private_engine import PrivacyEngine``
    dropin_ghost         the Opacus loop of opacus_ghost with ``from private_engine import PrivacyEngine``
    mixed_frozen         mixed, with the --frozen-set parameters (ViT cls_token, pos_embed, …) frozen
    bk_mixed_frozen      bk_mixed, likewise
    opacus_hooks_frozen  opacus_hooks, likewise
    opacus_ghost_frozen  opacus_ghost, likewise
    dropin_*_frozen      dropin_*, likewise (the Opacus-compatible API refuses parameters that need the tracer)

``--methods`` defaults to the core set (nondp, our six modes, opacus_hooks, opacus_ghost) on CPU
and to every method on CUDA; ``--methods all`` (or ``core``) selects them by name. A method that
cannot run the model (e.g. an engine without that clipping mode, or Opacus on parameters owned by
the model's root module) shows its error text in the table.

Models (``--models``; random initialisation, nothing downloaded): any timm or torchvision name
(``vgg11`` is torchvision's, without BatchNorm), and ``text_transformer``, built here: token +
learned position embeddings (two ``nn.Embedding``), 4 timm ViT blocks of width 256, LayerNorm, mean
pooling and a linear head, on random token ids of shape (batch, ``--seq-len``). The default is
ViT-Tiny on CPU and ``CUDA_MODELS`` (ViT-Tiny/-Small/-Base, ResNet-18/-50, VGG-11, the text model)
on CUDA. BatchNorm is replaced by GroupNorm (``private_engine.fix_batchnorm``) for every method.

``--amp bf16|fp16`` runs every method's forward under ``torch.autocast``; with fp16 non-DP training
and Opacus use a ``torch.amp.GradScaler`` and private_engine gets ``grad_scaler=`` (``--dtype``
instead casts the weights themselves).

Each method runs in its own subprocess (``--only METHOD``, driven step by step over a pipe), so
peak memory is not polluted by the other methods and every method starts from the same state. On
CPU the steps are interleaved by default (one step of each method per round), so changing
background load hits every method alike. Time is the median over the timed steps
(``time.perf_counter``, with ``torch.cuda.synchronize`` on CUDA), warm-up steps excluded. Peak
memory is the increase during the steps over what the process holds once the model, batch and
optimizer are built: ``torch.cuda.max_memory_allocated`` on CUDA, the peak resident set size
(VmHWM, reset through /proc/self/clear_refs; ``ru_maxrss`` otherwise) on CPU.

``--max-batch`` (CUDA only) then finds, for each method in a fresh subprocess, the largest batch
for which a full training step (two, to catch lazily allocated state) runs without running out of
GPU memory (``probe_max_batch``): the batch doubles from
``--batch-size`` until a step fails (at most ``--max-batch-cap``), then bisection between the last
size that fitted and the first that did not (``max_batch_by_bisection``).

The project's speed targets are reported as met or not for each of our methods: ≤ 1.15× non-DP time per
step (set for ViT-Tiny, batch 16, on CPU; on CUDA too), and on CUDA ≤ 1.10× non-DP peak memory and
a maximum batch ≥ 0.9× non-DP's. ``--plot PATH`` draws time and memory × non-DP per method (one
panel per model); with ``--markdown`` the figure defaults to ``benchmarks_<device>.png`` next to the
markdown file, which links it.

Examples::

    python bench/bench_clipping.py                                   # ViT-Tiny, 224², batch 16, core methods
    python bench/bench_clipping.py --device cuda --amp bf16 --max-batch   # the seven CUDA models
    python bench/bench_clipping.py --model text_transformer --seq-len 256 --methods nondp bk_mixed opacus_hooks
    python bench/bench_clipping.py --model resnet18 --img-size 64 --methods all --plot /tmp/resnet18.png
    python bench/bench_clipping.py --methods nondp mixed opacus_ghost --markdown docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import gc
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

FROZEN = "_frozen"  # suffix: the method with the --frozen-set parameters frozen
#: private_engine's clipping modes, each a method of the same name (two-pass, then single-backward book-keeping)
OUR_MODES = ("mixed", "ghost", "per_sample", "bk", "bk_mixed", "bk_mixopt")
OPACUS = ("opacus_hooks", "opacus_ghost")
DROPIN = ("dropin_hooks", "dropin_ghost")
METHODS = (("nondp",) + OUR_MODES + OPACUS + DROPIN
           + ("mixed" + FROZEN, "bk_mixed" + FROZEN, "opacus_hooks" + FROZEN, "opacus_ghost" + FROZEN,
              "dropin_hooks" + FROZEN, "dropin_ghost" + FROZEN))
#: our methods (compared with non-DP training and Opacus, checked against the targets)
OURS = OUR_MODES + DROPIN + ("mixed" + FROZEN, "bk_mixed" + FROZEN, "dropin_hooks" + FROZEN, "dropin_ghost" + FROZEN)
#: --methods core: every method that trains all parameters through a native API
CORE_METHODS = ("nondp",) + OUR_MODES + OPACUS
#: --methods shortcuts
METHOD_SETS = {"all": METHODS, "core": CORE_METHODS}
#: --methods default per device
DEFAULT_METHODS = {"cpu": CORE_METHODS, "cuda": CORE_METHODS}
#: parameters timm ViTs own directly (no layer around them): frozen in the ``*_frozen`` methods
TOKEN_PARAMS = ("cls_token", "pos_embed", "reg_token", "dist_token")
#: the small text model built by this script (not timm/torchvision), and its shape
TEXT_MODEL = "text_transformer"
TEXT_VOCAB, TEXT_DIM, TEXT_DEPTH, TEXT_HEADS = 8192, 256, 4, 4
#: models built from torchvision although timm has the same name (torchvision's VGG-11 has no BatchNorm)
TORCHVISION_MODELS = ("vgg11",)
CUDA_MODELS = ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "resnet18", "resnet50",
               "vgg11", TEXT_MODEL]
#: --models default
DEFAULT_MODELS = {"cpu": ["vit_tiny_patch16_224"], "cuda": CUDA_MODELS}
#: the speed targets for private_engine: seconds per step ≤ TIME × non-DP (set for ViT-Tiny, batch 16, on CPU;
#: checked on CUDA too); on CUDA peak memory ≤ MEMORY × non-DP and maximum batch ≥ MAX_BATCH × non-DP's
TIME_TARGET_RATIO = 1.15
MEMORY_TARGET_RATIO = 1.10
MAX_BATCH_TARGET_RATIO = 0.9
AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
SAMPLE_SIZE = 50_000  # only enters the accountant's sampling rate; irrelevant to speed and memory
RESULT_TAG = "@@bench-result@@ "
SKIPPED = "skipped:"  # error text of a method not run because it would repeat another
MIB = 2 ** 20


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", "--model", nargs="+", metavar="MODEL",
                   help=f"timm or torchvision model names (random init), or {TEXT_MODEL}; one table each; default "
                        f"{' '.join(DEFAULT_MODELS['cpu'])} on CPU, {' '.join(DEFAULT_MODELS['cuda'])} on CUDA")
    p.add_argument("--img-size", type=int, default=224, help=f"input height = width (ignored by {TEXT_MODEL})")
    p.add_argument("--seq-len", type=int, default=128, help=f"tokens per sample of {TEXT_MODEL}")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the weights and images (pure low precision)")
    p.add_argument("--amp", default="none", choices=("none",) + tuple(AMP_DTYPES),
                   help="mixed precision: the forward of every method under torch.autocast (fp16: with a GradScaler)")
    p.add_argument("--methods", nargs="+", choices=METHODS + tuple(METHOD_SETS), metavar="METHOD",
                   help=f"methods to run, from {', '.join(METHODS)}; or 'all', or 'core' "
                        f"({' '.join(CORE_METHODS)}). Default: core on CPU, all on CUDA")
    p.add_argument("--freeze", nargs="*", default=[], metavar="GLOB",
                   help="also freeze parameters whose name matches a glob, for every method (e.g. 'blocks.*')")
    p.add_argument("--frozen-set", nargs="+", default=list(TOKEN_PARAMS), metavar="GLOB",
                   help=f"parameters frozen in the *{FROZEN} methods (default: {' '.join(TOKEN_PARAMS)})")
    p.add_argument("--no-inplace", action="store_true",
                   help="set inplace=False on every module that has it (e.g. ReLU), for every method: Opacus' "
                        "full backward hooks reject in-place ops on the outputs of hooked layers")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", default="auto", choices=("auto", "interleaved", "sequential", "one-process"),
                   help="interleaved: one step of each method per round (robust to changing background load); "
                        "sequential: one method at a time (one subprocess alive); one-process (CPU only): "
                        "interleaved, every method timed in this process (no process-to-process offset; memory "
                        "is still measured per subprocess). auto: interleaved on CPU, sequential on CUDA")
    p.add_argument("--max-batch", action="store_true",
                   help="CUDA only: also find each method's largest batch that fits in GPU memory (doubling from "
                        "--batch-size, then bisection), each method in a fresh subprocess")
    p.add_argument("--max-batch-cap", type=int, default=4096, help="largest batch --max-batch tries")
    p.add_argument("--cuda-alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF for every method's subprocess (e.g. expandable_segments:True: the "
                        "caching allocator grows segments instead of splitting fixed ones; compare max batches)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds allowed for building a method, one step, or one method's --max-batch search")
    p.add_argument("--markdown", metavar="PATH", help="write (or replace) this run's section in a markdown file")
    p.add_argument("--plot", metavar="PATH",
                   help="write a figure (png) of time and memory × non-DP per method, one panel per model; with "
                        "--markdown the default is benchmarks_<device>.png next to the markdown file")
    p.add_argument("--only", choices=METHODS, help=argparse.SUPPRESS)  # internal: run one method, print JSON
    p.add_argument("--probe-max-batch", action="store_true", help=argparse.SUPPRESS)  # internal, with --only
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.schedule == "auto":
        args.schedule = "sequential" if args.device == "cuda" else "interleaved"
    if args.schedule == "one-process" and args.device != "cpu":
        p.error("--schedule one-process is for the CPU (on a GPU every method's model and memory would share it)")
    if not args.models:
        args.models = list(DEFAULT_MODELS[args.device])
    if args.only and len(args.models) != 1:
        p.error("--only runs one model")
    args.model = args.models[0]
    args.methods = select_methods(args.methods or DEFAULT_METHODS[args.device])
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be ≥ 1 and --warmup ≥ 0")
    if args.batch_size < 1 or args.seq_len < 1:
        p.error("--batch-size and --seq-len must be ≥ 1")
    if (args.max_batch or args.probe_max_batch) and args.device != "cuda":
        p.error("--max-batch needs --device cuda: it searches for the batch at which a step runs out of GPU memory; "
                "on CPU there is no such error to find (the machine would swap or the process be killed)")
    if args.max_batch and args.max_batch_cap < args.batch_size:
        p.error(f"--max-batch-cap ({args.max_batch_cap}) must be ≥ --batch-size ({args.batch_size})")
    args.plot_default = False
    has_matplotlib = args.only or importlib.util.find_spec("matplotlib") is not None
    if args.markdown and not args.plot and not args.only:
        if has_matplotlib:
            args.plot = str(Path(args.markdown).parent / f"benchmarks_{args.device}.png")
            args.plot_default = True
        else:
            print("note: no figure (matplotlib is not installed: pip install -e '.[plot]')", file=sys.stderr)
    elif args.plot and not has_matplotlib:  # fail now, not after the whole benchmark
        p.error("--plot needs matplotlib: pip install -e '.[plot]'")
    return args


def select_methods(names: List[str]) -> List[str]:
    """Expand the shortcuts ('all', 'core') and return the methods in the order of ``METHODS``."""
    chosen = set()
    for name in names:
        chosen.update(METHOD_SETS.get(name, (name,)))
    return [m for m in METHODS if m in chosen]


#: options forwarded from the parent to each per-method subprocess (the parent counts the steps)
FORWARDED = ("model", "img_size", "seq_len", "batch_size", "num_classes", "device", "dtype", "amp", "freeze",
             "frozen_set", "no_inplace", "max_grad_norm", "noise_multiplier", "lr", "seed", "max_batch_cap")


def child_command(args: argparse.Namespace, method: str, probe_max_batch: bool = False) -> List[str]:
    """The command line of the subprocess that runs ``method`` with the parent's settings."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--only", method] + (["--probe-max-batch"]
                                                                               if probe_max_batch else [])
    for name in FORWARDED:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd += [flag] if value else []
        elif isinstance(value, list):
            if value:
                cmd += [flag, *map(str, value)]
        else:
            cmd += [flag, str(value)]
    return cmd


# ---------------------------------------------------------------------------------------------
# Model, data and the methods (run inside the per-method subprocess)
# ---------------------------------------------------------------------------------------------
def build_model(args, method: str = "nondp"):
    """The model (fixed seed, so the same initialisation for every method) and notes on what was changed.

    Every parameter is trainable except those matching ``--freeze`` (every method) and, for the
    ``*_frozen`` methods, ``--frozen-set``. Nothing is frozen because private_engine lacks a rule:
    that method then fails and the table shows its error.
    """
    import torch
    import private_engine
    from private_engine.demo.models import create_model
    from private_engine.guards.model_check import batchnorm_modules, fallback_modules, traced_parameters

    torch.manual_seed(args.seed)
    model = _create(create_model, args)
    notes = {}
    if batchnorm_modules(model):
        model = private_engine.fix_batchnorm(model)
        notes["batchnorm"] = "BatchNorm replaced by GroupNorm (private_engine.fix_batchnorm) for every method"
    if args.no_inplace:
        inplace_activations_off(model)
        notes["inplace"] = "in-place activations disabled (--no-inplace) for every method"
    notes["traced"] = traced_parameters(model)  # how private_engine clips parameters outside layers
    notes["fallback"] = fallback_modules(model)
    by_glob = matching(model, args.freeze)
    by_set = matching(model, args.frozen_set) if method.endswith(FROZEN) else []
    if method.endswith(FROZEN) and not by_set:
        raise Skip(f"no parameter matches --frozen-set {' '.join(args.frozen_set)}: "
                   f"same as {method[:-len(FROZEN)]}")
    params = dict(model.named_parameters())
    for name in set(by_glob) | set(by_set):
        params[name].requires_grad_(False)
    notes["frozen_glob"] = by_glob
    notes["frozen_set"] = by_set
    notes["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtype = getattr(torch, args.dtype)
    return model.to(device=args.device, dtype=dtype).train(), notes


class Skip(Exception):
    """A method that would only repeat another one on this model (reported in the table, not run)."""


def matching(model, globs) -> List[str]:
    """Names of trainable parameters matching any of ``globs`` (fnmatch)."""
    return [n for n, p in model.named_parameters() if p.requires_grad and any(fnmatch.fnmatch(n, g) for g in globs)]


def _create(create_model, args):
    """The text model is built here; ``TORCHVISION_MODELS`` come from torchvision; timm models get ``img_size``
    when they take it (ViTs; CNNs do not need it). Random initialisation, nothing downloaded."""
    import timm

    if args.model == TEXT_MODEL:
        return text_transformer(args.num_classes, args.seq_len)
    if args.model in TORCHVISION_MODELS:
        import torchvision

        return torchvision.models.get_model(args.model, weights=None, num_classes=args.num_classes)
    if timm.is_model(args.model):
        try:
            return create_model(args.model, num_classes=args.num_classes, img_size=args.img_size)
        except TypeError:
            pass
    return create_model(args.model, num_classes=args.num_classes)


def text_transformer(num_classes: int, seq_len: int):
    """A small token classifier built from layers both libraries know: token and position embeddings
    (``nn.Embedding``), four timm transformer blocks (Linear, LayerNorm, SDPA attention), mean pooling and
    a Linear head. Input: token ids ``(B, seq_len)``."""
    import torch
    from timm.models.vision_transformer import Block
    from torch import nn

    class TextTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(TEXT_VOCAB, TEXT_DIM)
            self.positions = nn.Embedding(seq_len, TEXT_DIM)
            self.blocks = nn.Sequential(*[Block(TEXT_DIM, TEXT_HEADS, mlp_ratio=4.0, norm_layer=nn.LayerNorm)
                                          for _ in range(TEXT_DEPTH)])
            self.norm = nn.LayerNorm(TEXT_DIM)
            self.head = nn.Linear(TEXT_DIM, num_classes)

        def forward(self, ids):
            # batch-first ids, materialised: Opacus' ghost embedding norm calls .view() on them
            pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).contiguous()
            h = self.blocks(self.tokens(ids) + self.positions(pos))
            return self.head(self.norm(h).mean(1))

    return TextTransformer()


def make_batch(args, batch_size: Optional[int] = None):
    """A random batch of the right shape, identical for every method: images, or token ids for the text model."""
    import torch

    n = batch_size or args.batch_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    if args.model == TEXT_MODEL:
        x = torch.randint(0, TEXT_VOCAB, (n, args.seq_len), generator=gen).to(args.device)
    else:
        x = torch.randn(n, 3, args.img_size, args.img_size, generator=gen).to(args.device, getattr(torch, args.dtype))
    y = torch.randint(0, args.num_classes, (n,), generator=gen)
    return x, y.to(args.device)


def autocast(args):
    """The forward's autocast context for ``--amp`` (a no-op with ``--amp none``)."""
    import torch

    if args.amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(args.device, dtype=getattr(torch, AMP_DTYPES[args.amp]))


def grad_scaler(args):
    """A GradScaler for ``--amp fp16``, else None."""
    import torch

    return torch.amp.GradScaler(args.device) if args.amp == "fp16" else None


@dataclass
class Runner:
    """One method, ready to train: ``step()`` runs one full training step; ``describe()`` notes after the run."""

    step: Callable[[], None]
    describe: Callable[[], str] = lambda: ""


def sgd(model, args):
    import torch

    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr)


def setup_nondp(model, x, y, args) -> Runner:
    import torch.nn.functional as F

    opt = sgd(model, args)
    scaler = grad_scaler(args)

    def step():
        with autocast(args):
            out = model(x)
        backward_and_step(F.cross_entropy(out.float(), y), opt, scaler)

    return Runner(step)


def backward_and_step(loss, opt, scaler) -> None:
    """``loss.backward(); opt.step(); opt.zero_grad()``, through the GradScaler when there is one (fp16)."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)


def setup_ours(mode: str):
    def setup(model, x, y, args) -> Runner:
        import torch.nn.functional as F
        import private_engine

        opt = sgd(model, args)
        engine = private_engine.PrivacyEngine(model, batch_size=args.batch_size, sample_size=SAMPLE_SIZE,
                                              max_grad_norm=args.max_grad_norm,
                                              noise_multiplier=args.noise_multiplier, clipping_mode=mode,
                                              grad_scaler=grad_scaler(args))
        engine.attach(opt)

        def step():
            with autocast(args):
                out = model(x)
            opt.step(loss=F.cross_entropy(out.float(), y, reduction="none"))
            opt.zero_grad(set_to_none=True)

        def describe():
            plan = engine.layer_plan
            n_ghost = sum(d.use_ghost for d in plan)
            return f"{n_ghost} ghost / {len(plan) - n_ghost} instantiated layers"

        return Runner(step, describe)

    return setup


def setup_opacus(grad_sample_mode: str, dropin: bool = False):
    """Opacus' loop; with ``dropin`` the engine is ``private_engine.PrivacyEngine`` (Opacus-compatible form)."""
    def setup(model, x, y, args) -> Runner:
        import torch
        if dropin:
            from private_engine import PrivacyEngine as OpacusEngine
        else:
            from opacus import PrivacyEngine as OpacusEngine
        from torch.utils.data import DataLoader, TensorDataset

        inplace_off = [] if dropin else inplace_activations_off(model)
        opt = sgd(model, args)
        # The loader only tells Opacus the sampling rate and expected batch size (= batch_size);
        # the benchmark feeds the fixed batch itself, as for the other methods.
        loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
        criterion = torch.nn.CrossEntropyLoss()
        out = OpacusEngine().make_private(module=model, optimizer=opt, data_loader=loader, criterion=criterion,
                                          noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
                                          grad_sample_mode=grad_sample_mode, poisson_sampling=False)
        if grad_sample_mode == "ghost":
            dp_model, dp_opt, criterion, _ = out  # criterion's backward() runs both passes
        else:
            dp_model, dp_opt, _ = out

        scaler = grad_scaler(args)

        def step():
            with autocast(args):
                out = dp_model(x)
            backward_and_step(criterion(out.float(), y), dp_opt, scaler)

        def describe():
            if dropin:  # docs/migrating-from-opacus.md, "grad_sample_mode mapping"
                return ("criterion flow: one backward, book-keeping" if grad_sample_mode == "ghost"
                        else "plain backward: book-keeping, one backward")
            ft = opacus_functorch_modules(dp_model)
            notes = [f"functorch (vmap) per-sample gradients for: {', '.join(ft)}"] if ft else []
            if inplace_off:
                notes.append(f"in-place activations off ({len(inplace_off)} modules: Opacus' backward hooks "
                             "reject them)")
            return "; ".join(notes)

        return Runner(step, describe)

    return setup


def inplace_activations_off(model) -> List[str]:
    """Turn off ``inplace`` on every module that has it set (ReLU(inplace=True) in timm ResNets and torchvision's
    VGG): Opacus' full backward hooks fail on them ("Output 0 of BackwardHookFunction is a view and is being
    modified inplace"). Returns the names of the modules changed. private_engine and non-DP training keep them."""
    changed = []
    for name, m in model.named_modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
            changed.append(name)
    return changed


def opacus_functorch_modules(dp_model) -> List[str]:
    """Modules whose per-sample gradients Opacus computes with functorch (vmap of the module over the batch)
    because it has no grad sampler for their type; a trainable parameter owned by the root module (a timm
    ViT's ``cls_token``) puts the whole model there, and Opacus then hooks none of its layers."""
    inner = dp_model._module
    handled = {id(m) for m in dp_model.iterate_submodules(inner)}
    names = [name or f"{type(inner).__name__} (the whole model)" for name, m in inner.named_modules()
             if id(m) in handled and type(m) not in dp_model.GRAD_SAMPLERS]
    return names[:4] + ([f"… ({len(names)} modules)"] if len(names) > 4 else [])


SETUPS: Dict[str, Callable] = {
    "nondp": setup_nondp,
    **{mode: setup_ours(mode) for mode in OUR_MODES},
    "opacus_hooks": setup_opacus("hooks"),
    "opacus_ghost": setup_opacus("ghost"),
    "dropin_hooks": setup_opacus("hooks", dropin=True),
    "dropin_ghost": setup_opacus("ghost", dropin=True),
}
SETUPS.update({m: SETUPS[m[:-len(FROZEN)]] for m in METHODS if m.endswith(FROZEN)})  # same setup, fewer params


# ---------------------------------------------------------------------------------------------
# Measuring one method (subprocess side)
# ---------------------------------------------------------------------------------------------
class MemoryMeter:
    """Peak memory increase over a baseline: CUDA allocator statistics, or the process' peak RSS on CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.torch = torch
        self.exact_cpu_peak = False

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            self.exact_cpu_peak = _reset_peak_rss()
            self.base = _rss_bytes() if self.exact_cpu_peak else _maxrss_bytes()

    def peak(self) -> int:
        """Peak bytes since ``start`` (absolute). On the CPU the kernel's VmHWM, which ``start`` reset — not
        ``getrusage``'s ``ru_maxrss``: that one also keeps the high-water mark the process had before ``exec``,
        i.e. the RSS of the parent it was forked from (a benchmark parent holding models of its own would
        show through as every child's peak)."""
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated()
        return _status_bytes("VmHWM:") if self.exact_cpu_peak else _maxrss_bytes()

    def reserved_peak(self) -> Optional[int]:
        """CUDA: peak bytes the caching allocator reserved from the driver since ``start`` (absolute; what must fit on
        the device — above the allocated peak by what the allocator's segments hold unused); None on the CPU."""
        return self.torch.cuda.max_memory_reserved() if self.cuda else None

    def delta_mib(self, nbytes: int) -> float:
        return max(nbytes - self.base, 0) / MIB

    def held_mib(self) -> float:
        """Memory still held over the baseline (after garbage collection): a leak shows here."""
        import gc

        gc.collect()
        return self.delta_mib(self.torch.cuda.memory_allocated() if self.cuda else _rss_bytes())


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux ≥ 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int:
    """A size field of ``/proc/self/status`` (``VmRSS:``, ``VmHWM:``) in bytes; the peak RSS where it is missing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return _maxrss_bytes()


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def emit(payload: dict) -> None:
    """Send one message to the parent (the only lines the child writes that the parent reads)."""
    print(RESULT_TAG + json.dumps(payload), flush=True)


def error_text(e: BaseException) -> str:
    """``Type: first sentence`` of the message, its lines joined (so a list of names on the next lines shows)."""
    text = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    return f"{SKIPPED if isinstance(e, Skip) else type(e).__name__ + ':'} {text.split('. ')[0]}"[:300]


def build_runner(args, method: str, notes: dict) -> Runner:
    """``method`` ready to train on ``--batch-size``: its model, the batch and its setup. ``notes`` receives the
    model's notes as soon as the model is built, so that they survive a setup that then fails (e.g. a layer
    Opacus does not support) and the error row still says what was traced."""
    model, found = build_model(args, method)
    notes.update(found)
    x, y = make_batch(args)
    return SETUPS[method](model, x, y, args)


def run_child(args) -> None:
    """Subprocess entry point: build ``args.only``, then serve ``step`` / ``finish`` requests from stdin.

    Replies (one tagged JSON line each): ``{"ready": …}`` once built, ``{"time": s}`` per step,
    the measurements on ``finish``, or ``{"error": …}`` — e.g. a layer Opacus does not support.
    """
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if args.probe_max_batch:
        try:
            return emit(probe_max_batch(args))
        except Exception as e:  # not an out-of-memory error: the method cannot run at some size
            return emit({"error": error_text(e)})
    notes: dict = {}
    try:
        runner = build_runner(args, args.only, notes)
    except Exception as e:
        return emit({"error": error_text(e), **notes})
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    meter = MemoryMeter(args.device)
    meter.start()
    emit({"ready": True, **notes})
    first_peak = None
    for line in sys.stdin:
        if line.strip() == "step":
            try:
                sync()
                t0 = time.perf_counter()
                runner.step()
                sync()
            except Exception as e:
                return emit({"error": error_text(e)})
            elapsed = time.perf_counter() - t0
            first_peak = meter.peak() if first_peak is None else first_peak
            emit({"time": elapsed})
        elif line.strip() == "finish":
            peak = meter.peak()
            return emit({"peak_delta_mib": meter.delta_mib(peak),
                         "first_step_peak_delta_mib": meter.delta_mib(first_peak or peak),
                         "peak_total_mib": peak / MIB, "held_mib": meter.held_mib(),
                         **({"peak_reserved_mib": meter.reserved_peak() / MIB} if meter.cuda else {}),
                         "exact_cpu_peak": meter.exact_cpu_peak, "note": runner.describe(),
                         "threads": torch.get_num_threads(), **notes})


def max_batch_by_bisection(fits: Callable[[int], bool], start: int, cap: int) -> int:
    """The largest n ≤ cap with ``fits(n)``, assuming fits is monotone (True up to some n, then False):
    double from ``start`` until a failure (or the cap), then bisect between the last success and the first
    failure. 0 when even ``fits(1)`` fails."""
    start = max(1, min(start, cap))
    lo, hi = 0, None  # lo: largest size known to fit; hi: smallest known not to
    n = start
    while hi is None:
        if fits(n):
            lo = n
            if n >= cap:
                return cap
            n = min(2 * n, cap)
        else:
            hi = n
    while hi - lo > 1:  # lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def is_out_of_memory(e: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or a RuntimeError saying 'out of memory' (cuBLAS, cuDNN, older torch)."""
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or (isinstance(e, RuntimeError)
                                                         and "out of memory" in str(e).lower())


def probe_max_batch(args) -> int:
    """``{"max_batch": n, "oom": {...}}``: the largest physical batch for which a full training step of ``args.only``
    runs without CUDA out-of-memory (``max_batch_by_bisection`` from ``--batch-size`` up to ``--max-batch-cap``),
    and the allocator's state when the smallest batch that did not fit ran out (:func:`oom_state`). Each probe
    builds the model, a batch of its size and the method afresh (Opacus wraps the model), runs two steps (the
    second would show memory allocated lazily by the first), and frees everything before the next probe."""
    import torch

    failures: Dict[int, dict] = {}

    def attempt(n: int) -> bool:
        torch.cuda.reset_peak_memory_stats()
        model, _ = build_model(args, args.only)
        x, y = make_batch(args, n)
        runner = SETUPS[args.only](model, x, y, argparse.Namespace(**{**vars(args), "batch_size": n}))
        try:
            for _ in range(2):
                runner.step()
            torch.cuda.synchronize()
            return True
        except Exception as e:  # noqa: BLE001 - only running out of memory means "does not fit"
            if is_out_of_memory(e):
                failures[n] = oom_state(torch, e)
                return False
            raise
        finally:
            del model, x, y, runner

    def fits(n: int) -> bool:
        try:
            ok = attempt(n)
        except Exception as e:  # noqa: BLE001 - out of memory while building the model or batch
            if not is_out_of_memory(e):
                raise
            failures.setdefault(n, oom_state(torch, e))
            ok = False
        # attempt's frame (and the exception's traceback, which referenced its tensors) are gone here
        gc.collect()
        torch.cuda.empty_cache()
        return ok

    best = max_batch_by_bisection(fits, args.batch_size, args.max_batch_cap)
    return {"max_batch": best, **({"oom": {"batch": min(failures), **failures[min(failures)]}} if failures else {})}


def oom_state(torch, error: BaseException) -> dict:
    """The CUDA caching allocator when a step ran out of memory (MiB): bytes in live tensors, bytes reserved from
    the driver (their difference: free space inside the allocator's segments, too fragmented for the failed
    request), and the attempt's peak of live tensors; from the ``error``, the size of the request that failed
    ("Tried to allocate …": one huge tensor or workspace, or a small block that fragmentation refused) and
    where it was raised (:func:`raised_at`)."""
    state = {"allocated_mib": torch.cuda.memory_allocated() / MIB, "reserved_mib": torch.cuda.memory_reserved() / MIB,
             "peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB}
    request = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    if request:
        state["request"] = request.group(1)
    where = raised_at(error)
    if where:
        state["where"] = where
    return state


def raised_at(error: BaseException) -> str:
    """``file.py:line (function)`` of the innermost traceback frame of ``error`` in private_engine's code, else the
    innermost frame of all (a backward's error surfaces at the Python call that ran it, or in a hook)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if f"{os.sep}private_engine{os.sep}" in f.filename]
    f = (ours or frames)[-1]
    return f"{Path(f.filename).name}:{f.lineno} ({f.name})"


# ---------------------------------------------------------------------------------------------
# Parent: run every method, compute ratios, print and write the tables
# ---------------------------------------------------------------------------------------------
def child_env(args, memory: bool = False) -> Dict[str, str]:
    """The subprocess environment. For the CPU memory pass (``memory``), glibc's malloc gets a fixed mmap
    threshold: by default it raises the threshold as large blocks are freed and then keeps freed memory in
    its heap, so the peak RSS would count freed memory and depend on the allocation history (with the fixed
    threshold, the peak RSS increase matches PyTorch's own peak of allocated bytes within a few MiB). Timing
    runs keep the default allocator: the fixed threshold maps and faults in every large block again at each
    step, which slowed non-private ViT-Tiny steps by ~40 % and distorted the ratios."""
    env = dict(os.environ)
    if args.cuda_alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.cuda_alloc_conf
    if args.device == "cpu" and memory:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        env.setdefault("MALLOC_TRIM_THRESHOLD_", "65536")
    return env


class Worker:
    """One method in its own subprocess, driven step by step."""

    def __init__(self, args, method: str, memory: bool = False, probe_max_batch: bool = False):
        import queue
        import tempfile
        import threading

        self.method, self.timeout = method, args.timeout
        self.result: dict = {"method": method, "times": []}
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(child_command(args, method, probe_max_batch), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1,
                                     env=child_env(args, memory))
        self.replies: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._request(None)  # "ready" with the model notes (or the setup error; or the max batch)
        self.result.update({k: v for k, v in ready.items() if k != "ready"})
        if probe_max_batch:
            self.close()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                self.replies.put(line[len(RESULT_TAG):])
        self.replies.put(None)  # the child exited

    @property
    def ok(self) -> bool:
        return "error" not in self.result

    def _request(self, command: Optional[str]) -> dict:
        """Send ``command`` (None: just wait) and return the child's reply; failures end in ``result["error"]``."""
        import queue

        if not self.ok:
            return {}
        try:
            if command is not None:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            line = self.replies.get(timeout=self.timeout)
        except (queue.Empty, BrokenPipeError, OSError):
            line = None
            if self.proc.poll() is None:
                self.result["error"] = f"timed out after {self.timeout:.0f} s"
        if line is None:
            self.result.setdefault("error", self._crash_reason())
            self.close()
            return {}
        reply = json.loads(line)
        if "error" in reply:
            self.result.update(reply)  # the error, and the model notes when it was built
            self.close()
        return reply

    def _crash_reason(self) -> str:
        self.proc.poll()
        self.stderr.seek(0)
        tail = (self.stderr.read().strip().splitlines() or ["no output"])[-1]
        return f"crashed (exit {self.proc.returncode}): {tail}"[:300]

    def step(self) -> None:
        reply = self._request("step")
        if "time" in reply:
            self.result["times"].append(reply["time"])

    def finish(self) -> dict:
        self.result.update(self._request("finish"))
        self.close()
        return self.result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def run_all(args, methods: List[str]) -> Dict[str, dict]:
    """Run the methods, each in its own subprocess; return ``{method: result}``.

    "interleaved": all subprocesses are built first, then each round runs one step of every method
    (the starting method rotates), so a change in background load hits all methods alike.
    "sequential": one method after the other (one subprocess alive at a time).
    """
    from tqdm import tqdm

    rounds = args.warmup + args.steps
    memory_pass = args.device == "cpu"
    bar = tqdm(total=len(methods) * (rounds + 1 + 3 * memory_pass + args.max_batch), unit="step")

    def start(method):
        bar.set_postfix_str(f"building {method}")
        worker = Worker(args, method)
        bar.update()
        return worker

    def steps(worker, n):
        for _ in range(n):
            bar.set_postfix_str(worker.method)
            worker.step()
            bar.update()

    results = {}
    if args.schedule == "one-process":
        results = time_in_this_process(args, methods, bar)
    elif args.schedule == "sequential":
        for method in methods:
            worker = start(method)
            steps(worker, rounds)
            results[method] = worker.finish()
    else:
        workers = [start(m) for m in methods]
        for r in range(rounds):
            k = r % len(workers)
            for worker in workers[k:] + workers[:k]:
                steps(worker, 1)
        results = {w.method: w.finish() for w in workers}
    if memory_pass:  # a short second run per method with the fixed mmap threshold: the memory columns
        for method in methods:
            if "error" in results[method]:
                bar.update(3)
                continue
            worker = Worker(args, method, memory=True)
            bar.update()
            steps(worker, 2)
            mem = worker.finish()
            for key in ("peak_delta_mib", "first_step_peak_delta_mib", "held_mib", "exact_cpu_peak"):
                if key in mem:
                    results[method][key] = mem[key]
            if "error" in mem:
                results[method]["error"] = "memory pass: " + mem["error"]
    if args.max_batch:
        for method in methods:
            bar.set_postfix_str(f"max batch of {method}")
            if "error" not in results[method]:
                probe = Worker(args, method, probe_max_batch=True).result
                results[method]["max_batch"] = probe.get("max_batch")
                if "oom" in probe:
                    results[method]["max_batch_oom"] = probe["oom"]
                if "error" in probe:
                    results[method]["max_batch_error"] = probe["error"]
            bar.update()
    bar.close()
    for r in results.values():  # drop warm-up steps
        r["times"] = r["times"][args.warmup:]
        if r.get("times") and "error" not in r:
            r["median_s"] = statistics.median(r["times"])
    add_paired_ratios(results)
    return results


def time_in_this_process(args, methods: List[str], bar) -> Dict[str, dict]:
    """``--schedule one-process``: build every method here and time one step of each per round (the starting
    method rotates), as the interleaved schedule does across subprocesses. On a shared VM a subprocess can run
    10–20 % slower than another for its whole life, which neither interleaving nor repeats remove; in one process
    every method meets the same allocator, caches and placement; before each step the heap's free memory is given
    back (:func:`release_free_heap`). Returns ``{method: {"times": [...], notes}}``."""
    import warnings

    import torch

    results: Dict[str, dict] = {}
    runners: Dict[str, Runner] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in methods:
            bar.set_postfix_str(f"building {method}")
            notes: dict = {}
            try:
                runners[method] = build_runner(args, method, notes)
                results[method] = {"method": method, "times": [], **notes}
            except Exception as e:  # noqa: BLE001 - e.g. a layer Opacus does not support: a row with the error
                results[method] = {"method": method, "times": [], "error": error_text(e), **notes}
            bar.update()
        live = list(runners)
        for r in range(args.warmup + args.steps):
            k = r % max(len(live), 1)
            for method in live[k:] + live[:k]:
                bar.set_postfix_str(method)
                if "error" not in results[method]:
                    try:
                        release_free_heap()  # what the previous method freed goes back to the OS, as between processes
                        t0 = time.perf_counter()
                        runners[method].step()
                        results[method]["times"].append(time.perf_counter() - t0)
                    except Exception as e:  # noqa: BLE001
                        results[method]["error"] = error_text(e)
                bar.update()
            bar.update(len(methods) - len(live))
    for method in live:
        results[method].update(note=runners[method].describe(), threads=torch.get_num_threads())
    return results


def release_free_heap() -> None:
    """``malloc_trim(0)`` (glibc): give the heap's free memory back to the OS, so that a method timed after another
    in one process meets a heap as small as its own would be, not the pages another method's larger steps left
    mapped. Without it, ViT-Tiny's non-DP steps took 0.90 s in a one-process run with Opacus and 0.74 s in one
    without, while bk_mixed's took 0.95 and 0.94 s (1.07× against 1.21×); with it, 1.16× and 1.18×, with
    min–max spreads halved. A no-op where glibc is not the allocator."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def add_paired_ratios(results: Dict[str, dict]) -> None:
    """``time_ratio``: median over rounds of (step time / non-DP step time of the same round)."""
    ref = results.get("nondp", {}).get("times")
    for r in results.values():
        if ref and r.get("times") and len(r["times"]) == len(ref) and "error" not in r:
            r["time_ratio"] = statistics.median(t / t0 for t, t0 in zip(r["times"], ref))


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "—"


def results_table(results: Dict[str, dict], cuda: bool = False) -> List[List[str]]:
    """Rows of the main table: time and memory, with ratios to non-private training.

    On CUDA a column gives the absolute peak (``max_memory_allocated``, model included) too; on CPU
    the absolute RSS would mostly be the Python runtime and libraries, so only increases are shown.
    """
    ref = results.get("nondp", {})
    batch = any("max_batch" in r for r in results.values())
    rows = [["method", "trainable", "s/step (median)", "min–max", "time × non-DP", "peak mem Δ (MiB)", "mem × non-DP",
             "1st-step peak Δ", "held after"] + (["peak total (MiB)", "peak reserved (MiB)"] if cuda else [])
            + (["max batch", "max batch × non-DP"] if batch else []) + ["notes"]]
    for m, r in results.items():
        trainable = f"{r['trainable']:,}" if "trainable" in r else "—"
        if "error" in r:
            rows.append([m, trainable] + ["—"] * (len(rows[0]) - 3) + [r["error"]])
            continue
        mb = r.get("max_batch")
        rows.append([m, trainable, f"{r['median_s']:.3f}", f"{min(r['times']):.3f}–{max(r['times']):.3f}",
                     f"{r['time_ratio']:.2f}×" if "time_ratio" in r else ratio(r["median_s"], ref.get("median_s")),
                     f"{r['peak_delta_mib']:.0f}",
                     ratio(r["peak_delta_mib"], ref.get("peak_delta_mib")), f"{r['first_step_peak_delta_mib']:.0f}",
                     f"{r['held_mib']:.0f}"]
                    + ([f"{r['peak_total_mib']:.0f}", f"{r['peak_reserved_mib']:.0f}" if "peak_reserved_mib" in r
                        else "—"] if cuda else [])
                    + ([str(mb) if mb is not None else r.get("max_batch_error", "—"), ratio(mb, ref.get("max_batch"))]
                       if batch else []) + [r.get("note", "")])
    return rows


def counterpart(ours: str, opacus: str) -> str:
    """The Opacus method training the same parameters as ``ours``: ``opacus_hooks_frozen`` for ``mixed_frozen``."""
    return opacus + FROZEN if ours.endswith(FROZEN) else opacus


def versus_opacus_table(results: Dict[str, dict]) -> List[List[str]]:
    """Rows comparing each of our modes with each Opacus mode on the same trainable parameters
    (``*_frozen`` with ``*_frozen``); ratios < 1 favour private_engine, "—" where either failed."""
    ours = [m for m in OURS if "median_s" in results.get(m, {})]
    if not ours or not any("median_s" in results.get(counterpart(m, o), {}) for m in ours for o in OPACUS):
        return []
    rows = [["ours"] + [f"time / {o}" for o in OPACUS] + [f"mem / {o}" for o in OPACUS]]
    for m in ours:
        r, theirs = results[m], [results.get(counterpart(m, o), {}) for o in OPACUS]
        rows.append([m] + [ratio(r["median_s"], t.get("median_s")) for t in theirs]
                    + [ratio(r["peak_delta_mib"], t.get("peak_delta_mib")) for t in theirs])
    return rows


def _time_ratio(results: Dict[str, dict], m: str) -> float:
    r = results[m]
    return r.get("time_ratio", r["median_s"] / results["nondp"]["median_s"])


def target_lines(args, results: Dict[str, dict]) -> List[str]:
    """Issue 6's targets, met or not for each of our methods that ran (a failed one says why).

    CPU: seconds per step ≤ 1.15× non-DP (the target is set for ViT-Tiny at batch 16; other models are
    reported against the same bound). CUDA: the same time bound, peak memory Δ ≤ 1.10× non-DP's (the
    'mem × non-DP' column) and, with ``--max-batch``, a maximum batch ≥ 0.9× non-DP's.
    """
    ref = results.get("nondp", {})
    if "median_s" not in ref:
        return []
    ran = [m for m in OURS if "median_s" in results.get(m, {})]
    failed = [f"{m}: failed ({results[m]['error'][:120]})" for m in OURS
              if "error" in results.get(m, {}) and not results[m]["error"].startswith(SKIPPED)]

    def line(what: str, bound: float, values: Dict[str, float], at_least: bool = False, first: bool = False) -> str:
        parts = [f"{m}: {x:.2f}× ({'met' if (x >= bound if at_least else x <= bound) else 'not met'})"
                 for m, x in values.items()] + (failed if first else [])  # failures once, in the first line
        return f"{what} {'≥' if at_least else '≤'} {bound}× non-DP — " + "; ".join(parts or ["none ran"]) + "."

    times = {m: _time_ratio(results, m) for m in ran}
    if args.device == "cpu":
        return [line("Target on CPU (set for vit_tiny_patch16_224 at batch 16): private_engine time per "
                     "step", TIME_TARGET_RATIO, times, first=True)] if ran or failed else []
    lines = [line("Target on CUDA: private_engine time per step", TIME_TARGET_RATIO, times, first=True)]
    if ref.get("peak_delta_mib"):
        mems = {m: results[m]["peak_delta_mib"] / ref["peak_delta_mib"] for m in ran}
        lines.append(line("Target on CUDA: private_engine peak memory Δ", MEMORY_TARGET_RATIO, mems))
    if ref.get("max_batch"):
        batches = {m: results[m]["max_batch"] / ref["max_batch"] for m in ran if results[m].get("max_batch") is not None}
        lines.append(line("Target on CUDA: private_engine max batch", MAX_BATCH_TARGET_RATIO, batches,
                          at_least=True))
    elif args.device == "cuda":
        lines.append(f"Target on CUDA: private_engine max batch ≥ {MAX_BATCH_TARGET_RATIO}× non-DP — "
                     "not measured (run with --max-batch).")
    return lines


def format_text(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(" --- " for _ in rows[0]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def machine_info(device: str, load: Optional[float] = None) -> Dict[str, str]:
    import opacus
    import timm
    import torch

    cpu = platform.processor() or "unknown CPU"
    mem = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        with open("/proc/meminfo") as f:
            kib = int(next(l.split()[1] for l in f if l.startswith("MemTotal")))
            mem = f", {kib / 2 ** 20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    busy = f", 1-min load average {load:.1f} at start" if load is not None else ""
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores (torch threads: {torch.get_num_threads()}){mem}{busy}",
        "device": name,
        "software": f"Python {platform.python_version()}, torch {torch.__version__}, timm {timm.__version__}, "
                    f"opacus {opacus.__version__}",
    }


def engine_revision() -> str:
    """The git commit measured, flagged when private_engine/ has uncommitted changes."""
    repo = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "private_engine"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.rstrip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty.splitlines()]
    return rev + (f" (uncommitted changes: {', '.join(changed)})" if changed else "")


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def setup_lines(args, results: Dict[str, dict]) -> List[str]:
    """What the methods trained, read back from the subprocesses (those that got as far as building the model)."""
    ok = next((r for r in results.values() if "trainable" in r), None)
    data = (f"fixed random token ids ({args.seq_len} per sample, vocabulary {TEXT_VOCAB}; --img-size ignored)" if args.model == TEXT_MODEL
            else "a fixed random batch")
    amp = {"none": "", "bf16": ", bfloat16 autocast", "fp16": ", float16 autocast + GradScaler"}[args.amp]
    lines = [f"SGD (lr {args.lr}), cross-entropy on {data}, {args.num_classes} classes, "
             f"σ = {args.noise_multiplier}, R = {args.max_grad_norm}, {args.dtype}{amp}; "
             f"{args.steps} timed steps after {args.warmup} warm-up, median; "
             + ("every method timed in one process, interleaved (one step of each method per round; 'time × non-DP' "
                "is the median of the per-round ratios; memory from one subprocess per method)."
                if args.schedule == "one-process" else
                f"one subprocess per method, {args.schedule}"
                + (" (one step of each method per round; 'time × non-DP' is the median of the per-round ratios)."
                   if args.schedule == "interleaved" else "."))]
    if ok is None:
        return lines
    frozen_set = next((r["frozen_set"] for r in results.values() if r.get("frozen_set")), [])
    lines.append("All parameters trainable" + (f" except, in the *{FROZEN} methods, {', '.join(frozen_set)}"
                                               if frozen_set else "") + " ('trainable' column).")
    if ok.get("traced"):
        lines.append(f"private_engine clips by its parameter-entry tracer: {', '.join(ok['traced'][:6])}"
                     + (f", … ({len(ok['traced'])} in all)" if len(ok["traced"]) > 6 else "") + ".")
    if ok.get("fallback"):
        lines.append(f"private_engine clips by its torch.func fallback: {', '.join(ok['fallback'])}.")
    if ok.get("frozen_glob"):
        lines.append(f"Frozen by --freeze: {len(ok['frozen_glob'])} parameters.")
    for key in ("batchnorm", "inplace"):
        if ok.get(key):
            lines.append(ok[key][0].upper() + ok[key][1:] + ".")
    mem = ("torch.cuda.max_memory_allocated" if args.device == "cuda" else
           "peak RSS (VmHWM reset per method) in a second, 2-step run per method with glibc's mmap threshold fixed "
           "(timed steps use the default allocator)" if ok.get("exact_cpu_peak") else "ru_maxrss")
    lines.append(f"Peak memory: increase over model + batch + optimizer during all steps, by {mem}; "
                 "'1st-step peak Δ': the same over the first step only; 'held after': still allocated after the "
                 "last step (MiB). The three agree unless memory grows from step to step.")
    if args.amp == "fp16":
        lines.append("float16 autocast: non-DP training and Opacus scale the loss with torch.amp.GradScaler "
                     "(scaler.scale(loss).backward(); scaler.step(opt); scaler.update() — Opacus then clips the scaled "
                     "per-sample gradients: timing only); private_engine gets PrivacyEngine(grad_scaler=GradScaler).")
    elif args.amp == "bf16":
        lines.append("bfloat16 autocast around every method's forward (no loss scaling); weights in "
                     f"{args.dtype}.")
    if args.cuda_alloc_conf:
        lines.append(f"PYTORCH_CUDA_ALLOC_CONF={args.cuda_alloc_conf} for every method.")
    if any("max_batch" in r for r in results.values()):
        lines.append(f"Max batch: largest physical batch whose full step (two steps, fresh model) ran without CUDA "
                     f"out-of-memory, by doubling from {args.batch_size} then bisection (cap {args.max_batch_cap}).")
        lines += oom_lines(results)
    return lines + target_lines(args, results)


def oom_lines(results: Dict[str, dict]) -> List[str]:
    """One line per method on the allocator at the out-of-memory error of the smallest batch that did not fit."""
    lines = []
    for m, r in results.items():
        o = r.get("max_batch_oom")
        if o:
            lines.append(f"{m} at batch {o['batch']} (first that did not fit): out of memory with {o['allocated_mib']:,.0f} "
                         f"MiB in tensors and {o['reserved_mib']:,.0f} MiB reserved "
                         f"({o['reserved_mib'] - o['allocated_mib']:,.0f} MiB free inside the allocator's segments); "
                         f"that attempt's peak in tensors {o['peak_allocated_mib']:,.0f} MiB"
                         + (f"; the request that failed: {o['request']}" if o.get("request") else "")
                         + (f", raised in {o['where']}" if o.get("where") else "") + ".")
    return lines


def section_key(args) -> str:
    size = f"t{args.seq_len}" if args.model == TEXT_MODEL else str(args.img_size)
    return (f"{args.model}-{size}-b{args.batch_size}-{args.device}-{args.dtype}"
            + (f"-amp{args.amp}" if args.amp != "none" else "") + ("-noinplace" if args.no_inplace else "")
            + (f"-alloc-{args.cuda_alloc_conf}" if args.cuda_alloc_conf else "")
            + ("-oneprocess" if args.schedule == "one-process" else ""))


def title(args, info: Dict[str, str]) -> str:
    size = f"{args.seq_len} tokens" if args.model == TEXT_MODEL else f"{args.img_size}×{args.img_size}"
    amp = f", {args.amp} autocast" if args.amp != "none" else ""
    where = ": timed in one process" if args.schedule == "one-process" else ""
    return f"{args.model}, {size}, batch {args.batch_size}, {info['device']} ({args.dtype}{amp}){where}"


def markdown_section(args, results: Dict[str, dict], info: Dict[str, str]) -> str:
    key = section_key(args)
    body = [f"<!-- bench:{key} -->",
            f"### {title(args, info)}", "",
            f"- Date: {datetime.date.today().isoformat()}",
            f"- Machine: {info['machine']}; device: {info['device']}",
            f"- Software: {info['software']}; private_engine at commit {engine_revision()}",
            f"- Command: `{command_line()}`"]
    body += [f"- {line}" for line in setup_lines(args, results)]
    if args.plot:
        link = Path(os.path.relpath(args.plot, Path(args.markdown).parent)).as_posix() if args.markdown else args.plot
        body.append(f"- Figure (time and memory × non-DP, every model of this run): [{Path(args.plot).name}]({link})")
    body += ["", format_markdown(results_table(results, args.device == "cuda"))]
    vs = versus_opacus_table(results)
    if vs:
        body += ["", "private_engine vs Opacus (ratios below 1 favour private_engine):", "", format_markdown(vs)]
    body += [f"<!-- /bench:{key} -->"]
    return "\n".join(body) + "\n"


def write_markdown(path: Path, section: str, key: str) -> None:
    """Replace this configuration's section in ``path`` (between its markers), or append it."""
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nWritten by `bench/bench_clipping.py`.\n"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.only:
        run_child(args)
        return
    everything: Dict[str, Dict[str, dict]] = {}
    for model in args.models:
        args.model = model
        everything[model] = run_model(args)
        if args.plot:  # redrawn after each model: a later failure still leaves the figure of the ones done
            write_plot(args, everything)


def write_plot(args, everything: Dict[str, Dict[str, dict]]) -> None:
    """``--plot`` (or its default next to ``--markdown``): one figure for every model run so far."""
    amp = f", {args.amp} autocast" if args.amp != "none" else ""
    subtitle = f"{args.device}, batch {args.batch_size}, {args.dtype}{amp}, {datetime.date.today().isoformat()}"
    plot_results(everything, Path(args.plot), subtitle, cuda=args.device == "cuda")
    print(f"wrote {args.plot}")


def run_model(args) -> Dict[str, dict]:
    """Every method on ``args.model``: run, print the tables, write the markdown section."""
    methods = [m for m in METHODS if m in args.methods]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = run_all(args, methods)
    info = machine_info(args.device, load)
    print(f"\n{title(args, info)}\n{info['machine']}\n{info['software']}; private_engine at commit {engine_revision()}")
    for line in setup_lines(args, results):
        print(line)
    print("\n" + format_text(results_table(results, args.device == "cuda")))
    vs = versus_opacus_table(results)
    if vs:
        print("\nprivate_engine vs Opacus (ratios below 1 favour private_engine):\n" + format_text(vs))
    if args.markdown:
        write_markdown(Path(args.markdown), markdown_section(args, results, info), section_key(args))
        print(f"\nwrote {args.markdown}")
    return results


def plot_results(everything: Dict[str, Dict[str, dict]], path: Path, subtitle: str = "", cuda: bool = False) -> None:
    """Write a png with one panel per model: for every method, grouped bars of time × non-DP and peak memory
    × non-DP (and max batch × non-DP when measured), a dashed line at 1 and dashed lines at the targets.
    A method that failed gets a 'failed' mark instead of bars (the tables say why); a model whose non-DP run
    failed has no ratios and is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, res in everything.items() if "median_s" in res.get("nondp", {})]
    if not models:
        print(f"no plot: no model has a non-DP result to compare with; {path} not written")
        return
    methods = [m for m in METHODS if any(m in everything[model] for model in models)]
    fig, axes = plt.subplots(len(models), 1, figsize=(max(8.0, 0.9 * len(methods) + 2), 3.2 * len(models) + 0.8),
                             squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        res = everything[model]
        ref = res["nondp"]
        series = [("time × non-DP", "#1f77b4", TIME_TARGET_RATIO,
                   lambda m: _time_ratio(res, m)),
                  ("peak memory × non-DP", "#ff7f0e", MEMORY_TARGET_RATIO if cuda else None,
                   lambda m: res[m]["peak_delta_mib"] / ref["peak_delta_mib"] if ref.get("peak_delta_mib") else None)]
        if ref.get("max_batch"):
            series.append(("max batch × non-DP", "#2ca02c", MAX_BATCH_TARGET_RATIO,
                           lambda m: res[m]["max_batch"] / ref["max_batch"] if res[m].get("max_batch") else None))
        width = 0.8 / len(series)
        top = 1.0
        for k, (label, color, target, value) in enumerate(series):
            xs, ys = [], []
            for i, m in enumerate(methods):
                v = value(m) if "median_s" in res.get(m, {}) else None
                if v is not None:
                    xs.append(i + (k - (len(series) - 1) / 2) * width)
                    ys.append(v)
            bars = ax.bar(xs, ys, width, color=color, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
            top = max([top] + ys)
            if target is not None:
                ax.axhline(target, color=color, lw=1, ls="--", label=f"target {target}× ({label.split(' ×')[0]})")
        ax.axhline(1.0, color="black", lw=0.8, ls="--", label="non-DP (1×)")
        for i, m in enumerate(methods):
            if m not in res:
                ax.text(i, 0.05 * top, "not run", ha="center", rotation=90, fontsize=7, color="grey")
            elif "median_s" not in res[m]:
                skipped = res[m].get("error", "").startswith(SKIPPED)
                ax.text(i, 0.05 * top, "skipped" if skipped else "failed", ha="center", rotation=90, fontsize=7,
                        color="grey" if skipped else "red")
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("× non-DP")
        ax.set_title(model, fontsize=10)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"private_engine and Opacus relative to non-private training; {subtitle}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
