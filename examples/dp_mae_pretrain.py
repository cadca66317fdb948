#!/usr/bin/env python
"""DP-MAES: masked-autoencoder pre-training with a synthetic warm start, then DP-AdamW on the
private images (Yu et al., "ViP: A Differentially Private Foundation Model for Computer Vision").

Step 1 trains a masked autoencoder (a timm ViT encoder, 75 % of the patches masked, a different
mask per sample) on procedural images (``private_engine.pretrain.synthetic``: smooth colour
fields, warped stripes, fractal noise, geometric shapes — no download, no private data) with
plain AdamW. Step 2 continues from those weights on the private images with DP-AdamW: per-sample
clipping at C = 0.1 of every parameter (tokens and position embeddings included), Poisson
batches, σ calibrated for ε = 8 and δ = 1/(2n), the logical batch accumulated over physical
chunks. The default private data are scikit-learn's embedded digits (no download); ``--data
folder|cifar10|cifar100 --data-dir DIR`` as in ``examples/finetune_timm_vit.py``.

Checkpoints go to ``--out-dir`` (default ``outputs/dp_mae_pretrain`` in the checkout, ignored by
git): ``synthetic.pt`` after step 1, ``dp_mae.pt`` after every DP
epoch (model, optimizer and engine: secret, like the data), ``dp_mae_final.pt`` (the model);
``--resume`` continues from them. ``--probe`` compares random init, synthetic only and synthetic
+ DP-MAE by their masked-reconstruction loss on the test images and linear probes on the
encoder's features (non-private logistic regression and the DP heads of
``private_engine.heads``), printed as a table, with ``--table``/``--plot`` files. The last line
reads ``ε=… δ=… σ=… loss=… loss_synthetic=… loss_random=… seconds=…`` (test losses).

Examples::

    python examples/dp_mae_pretrain.py                       # digits, a few minutes on 2 cores
    python examples/dp_mae_pretrain.py --probe --plot docs/pretrain_probe.png
    torchrun --standalone --nproc_per_node=2 examples/dp_mae_pretrain.py --device cpu

Randomness: ``--seed`` fixes what is public (the model's initialisation, the synthetic images,
the data split and the evaluation masks). The masks and the order of step 1, the masks of step 2
(each sample's mask a keyed function of the step and of its own pixels, with a secret 256-bit
key: ``private_engine.pretrain.masks``), the Poisson batches and the DP noise are secret, from OS
entropy; ``--mask-seed`` makes the masks and step 1's order reproducible (with a
``ReproducibleRandomnessWarning``).

Under ``torchrun`` every process runs step 1 (each with its own secret masks; the engine
broadcasts rank 0's weights when step 2 starts), step 2 trains on its share of each Poisson
batch with rank 0's mask key, the engine sums the clipped gradients across processes and adds
the noise once; rank 0 logs, evaluates and writes. ``--tensorboard DIR``: a TensorBoard log of
every DP step's ε, loss, clip fraction and dropped samples (the last three are non-private
statistics of the batch; docs/engine.md, "Logging and monitoring").
"""
from __future__ import annotations

import argparse
import builtins
import copy
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Tuple

import torch
from torch.utils.data import Subset

from private_engine.checkpoint import atomic_save
from private_engine.demo.image_data import SOURCES, load_image_data, model_data_config
from private_engine.pretrain import (
    DPMAEConfig,
    SyntheticConfig,
    SyntheticImages,
    build_mae,
    dp_mae_train,
    format_comparison,
    plot_comparison,
    pretrain_synthetic,
    probe_encoder,
    reconstruction_loss,
)

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default="vit_tiny_patch16_224", help="timm ViT name (encoder)")
    m.add_argument("--img-size", type=int, default=16)
    m.add_argument("--patch-size", type=int, default=4)
    m.add_argument("--depth", type=int, default=4, help="encoder blocks")
    m.add_argument("--embed-dim", type=int, help="encoder width (default: the model's)")
    m.add_argument("--num-heads", type=int, help="encoder heads (default: the model's)")
    m.add_argument("--decoder-dim", type=int, default=128)
    m.add_argument("--decoder-depth", type=int, default=2)
    m.add_argument("--decoder-heads", type=int, default=4)
    m.add_argument("--mask-ratio", type=float, default=0.75)
    d = p.add_argument_group("data")
    d.add_argument("--data", default="digits", choices=SOURCES)
    d.add_argument("--data-dir", help="folder of --data folder / cifar10 / cifar100")
    d.add_argument("--subset", type=int, help="private training set: the first N examples")
    s = p.add_argument_group("step 1: synthetic pre-training (non-private AdamW)")
    s.add_argument("--synthetic-images", type=int, default=8000)
    s.add_argument("--synthetic-epochs", type=int, default=3)
    s.add_argument("--synthetic-batch-size", type=int, default=128)
    s.add_argument("--synthetic-lr", type=float, default=1.5e-3)
    q = p.add_argument_group("step 2: DP-AdamW on the private images")
    q.add_argument("--epsilon", type=float, default=8.0)
    q.add_argument("--delta", type=float, help="default 1/(2n)")
    q.add_argument("--max-grad-norm", type=float, default=0.1, help="clipping threshold C")
    q.add_argument("--epochs", type=int, default=10)
    q.add_argument("--batch-size", type=int, default=256, help="expected logical batch")
    q.add_argument("--physical-batch-size", type=int, default=64)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--weight-decay", type=float, default=0.05)
    q.add_argument("--clipping-mode", default="bk_mixed")
    q.add_argument("--accountant", default="rdp", choices=["rdp", "prv", "gdp", "pld"])
    e = p.add_argument_group("evaluation and output")
    e.add_argument("--probe", action="store_true",
                   help="compare random init / synthetic / synthetic + DP-MAE with linear probes")
    e.add_argument("--probe-epsilons", type=float, nargs="+", default=[1.0, 8.0],
                   help="ε of the DP linear heads (a non-private head is added)")
    e.add_argument("--probe-methods", nargs="+", default=["ls", "newton"],
                   help="DP heads (private_engine.heads.probe.METHODS)")
    e.add_argument("--compare-random-dp", action="store_true",
                   help="also run step 2 from the random initialisation (no warm start)")
    e.add_argument("--table", help="write the probe table (markdown) here")
    e.add_argument("--plot", help="write the loss / probe plot (PNG) here")
    e.add_argument("--out-dir", default=str(ROOT / "outputs" / "dp_mae_pretrain"),
                   help="checkpoints (default: outputs/dp_mae_pretrain in the checkout)")
    e.add_argument("--resume", action="store_true", help="continue from --out-dir")
    e.add_argument("--quiet", action="store_true", help="no progress bars or epoch lines")
    e.add_argument("--tensorboard", metavar="DIR",
                   help="write every DP step's ε, loss, clip fraction and dropped samples to a "
                   "TensorBoard log in DIR (needs the tensorboard package)")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0,
                   help="model initialisation, synthetic images, data split and evaluation masks "
                        "(public); never the training masks, the DP noise or the Poisson "
                        "sampling (OS entropy)")
    p.add_argument("--mask-seed", type=int,
                   help="make the training masks and step 1's order reproducible (default: "
                        "secret, from OS entropy)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.data != "digits" and not args.data_dir:
        p.error(f"--data {args.data} needs --data-dir DIR")
    return args


def setup_distributed(args) -> Tuple[int, torch.device]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the process group (NCCL on CUDA with one GPU
    per process, gloo on the CPU) and return ``(rank, device)``; otherwise ``(0, --device)``."""
    device = torch.device(args.device)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, device
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), device


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rank, device = setup_distributed(args)
    print = builtins.print if rank == 0 else (lambda *a, **k: None)  # noqa: A001 (rank 0 logs)
    progress = not args.quiet and rank == 0
    # the library's epoch lines go through logging (private_engine.pretrain.recipe)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("private_engine").setLevel(logging.INFO if progress else logging.WARNING)
    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    start = time.perf_counter()

    model = build_mae(args.model, img_size=args.img_size, patch_size=args.patch_size,
                      depth=args.depth, embed_dim=args.embed_dim, num_heads=args.num_heads,
                      decoder_dim=args.decoder_dim, decoder_depth=args.decoder_depth,
                      decoder_heads=args.decoder_heads, mask_ratio=args.mask_ratio).to(device)
    config = model_data_config(model.encoder, args.img_size)
    train, test, classes = load_image_data(args.data, config, args.data_dir, args.seed)
    if args.subset is not None:
        train = Subset(train, range(min(args.subset, len(train))))
    synthetic = SyntheticImages(args.synthetic_images, size=args.img_size, seed=args.seed,
                                channels=config["input_size"][0], mean=config["mean"],
                                std=config["std"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MAE on {args.model} ({args.depth} blocks) at {args.img_size}px, patch "
          f"{args.patch_size}, mask ratio {args.mask_ratio}: {n_params:,} parameters; synthetic "
          f"{len(synthetic)} images; private {args.data} n={len(train)}, test {len(test)}")

    def evaluate(m=model):
        return reconstruction_loss(m, test, seed=args.seed, device=device)

    os.makedirs(args.out_dir, exist_ok=True)
    random_state = copy.deepcopy(model.state_dict())
    loss_random = evaluate()
    curves = {}

    # step 1: synthetic pre-training (non-private)
    syn_path = os.path.join(args.out_dir, "synthetic.pt")
    if args.resume and os.path.exists(syn_path):
        model.load_state_dict(torch.load(syn_path, map_location=device, weights_only=True))
        print(f"step 1: loaded {syn_path}")
        curves["synthetic"] = [loss_random, evaluate()]
    else:
        evals = []
        cfg1 = SyntheticConfig(epochs=args.synthetic_epochs,
                               batch_size=args.synthetic_batch_size, lr=args.synthetic_lr)

        def eval_syn():  # test loss before step 1 and after each of its epochs
            evals.append(evaluate())
            return evals[-1]

        pretrain_synthetic(model, synthetic, cfg1, device=device, seed=args.mask_seed,
                           progress=progress, evaluate=eval_syn)
        curves["synthetic"] = evals
        if rank == 0:
            atomic_save(model.state_dict(), syn_path)
    synthetic_state = copy.deepcopy(model.state_dict())
    loss_synthetic = evaluate()
    print(f"step 1 done: test loss random init {loss_random:.4f} → synthetic "
          f"{loss_synthetic:.4f}")

    # step 2: DP-AdamW on the private images
    cfg2 = DPMAEConfig(epsilon=args.epsilon, delta=args.delta,
                       max_grad_norm=args.max_grad_norm, epochs=args.epochs,
                       batch_size=args.batch_size, physical_batch_size=args.physical_batch_size,
                       lr=args.lr, weight_decay=args.weight_decay,
                       clipping_mode=args.clipping_mode, accountant=args.accountant)
    result = dp_mae_train(model, train, cfg2, device=device,
                          checkpoint=os.path.join(args.out_dir, "dp_mae.pt"),
                          resume=args.resume, mask_seed=args.mask_seed, progress=progress,
                          evaluate=evaluate, step_logger=writer)
    if writer is not None:
        writer.close()
    curves["synthetic + DP-MAE"] = result.evaluations
    if rank == 0:
        atomic_save(model.state_dict(), os.path.join(args.out_dir, "dp_mae_final.pt"))
    loss_dp = evaluate()

    rows = []
    if args.probe and rank == 0:
        probe = dict(methods=tuple(args.probe_methods),
                     epsilons=tuple(args.probe_epsilons) + (math.inf,),
                     delta=1 / (2 * len(train)), seeds=3, device=device, loss_seed=args.seed,
                     blank=_blank(config))
        reference = copy.deepcopy(model)
        stages = [("random init", random_state), ("synthetic only", synthetic_state)]
        if args.compare_random_dp:
            reference.load_state_dict(random_state)
            dp_random = dp_mae_train(reference, train, cfg2, device=device,
                                     mask_seed=args.mask_seed,
                                     progress=progress, evaluate=lambda: evaluate(reference))
            curves["random init + DP-MAE"] = dp_random.evaluations
            stages.append(("random init + DP-MAE", copy.deepcopy(reference.state_dict())))
        for name, state in stages:
            reference.load_state_dict(state)
            rows.append(probe_encoder(name, reference, train, test, **probe))
        rows.append(probe_encoder("synthetic + DP-MAE", model, train, test, **probe))
        table = format_comparison(rows)
        print(f"\n{args.data}: test masked-reconstruction loss and linear-probe test accuracy (%)"
              f"; DP heads: mean ± std over 3 noise seeds, δ = 1/(2n); DP-MAE at "
              f"ε = {result.epsilon:.2f}\n")
        print(table)
        if args.table:
            with open(args.table, "w") as fh:
                fh.write(table + "\n")
        if args.plot:
            starts = {"synthetic + DP-MAE": len(curves["synthetic"]) - 1}
            plot_comparison(rows, curves, args.plot, starts=starts,
                            title=f"DP-MAES on {args.data}: ε={result.epsilon:.2f}, "
                                  f"δ={result.delta:.2g}, C={args.max_grad_norm}")
            print(f"plot saved to {args.plot}")
    seconds = time.perf_counter() - start
    print(f"ε={result.epsilon:.3f} δ={result.delta:.2e} σ={result.noise_multiplier:.4f} "
          f"loss={loss_dp:.4f} loss_synthetic={loss_synthetic:.4f} loss_random={loss_random:.4f} "
          f"seconds={seconds:.1f}")
    return {"epsilon": result.epsilon, "delta": result.delta, "loss": loss_dp,
            "loss_synthetic": loss_synthetic, "loss_random": loss_random, "rows": rows,
            "curves": curves}


def _blank(config) -> torch.Tensor:
    """A black image in the model's normalisation: ``(0 − mean)/std`` per channel (a
    data-independent centring of the features)."""
    c, h, w = config["input_size"]
    mean = torch.tensor(config["mean"]).view(c, 1, 1)
    std = torch.tensor(config["std"]).view(c, 1, 1)
    return ((torch.zeros(c, h, w) - mean) / std).float()


def cli(argv=None):
    """``main`` for the command line: missing data ends with its message, no traceback."""
    try:
        main(argv)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    cli()
