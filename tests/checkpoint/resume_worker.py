"""A small reproducible DP training run that checkpoints after every physical batch and can kill
itself: the subprocess of tests/checkpoint/test_native_checkpoint.py.

A 2-layer MLP on 64 random samples, Poisson batches of expected size 16 (4 per epoch) from a seeded
generator, split into physical batches of 5 (``virtual_step`` on all but the last, ``step`` on the
last), Adam, noise from a seeded generator. After each physical batch: ``save_checkpoint`` with
``extra`` = the loader generator's state at the start of the epoch and the position in it (the
logical batch and the physical chunk to do next), then one line on stdout:
``PHYSICAL <k> STEP <logical steps done> ACCUMULATING <0|1> EPOCH <e> BATCH <b>``.

    python resume_worker.py --ckpt C --out O --steps N [--kill-at K] [--kill-in-save K] [--resume]

``--kill-at K``: SIGKILL itself right after the checkpoint of physical batch K is written.
``--kill-in-save K``: SIGKILL itself halfway through writing that checkpoint (``torch.save``
replaced by one that writes half of the bytes, flushes, fsyncs and kills the process).
``--resume``: start from the checkpoint. At the end: the parameters and ε to ``O``.
"""
import argparse
import io
import os
import signal
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import private_engine as pe
from private_engine.data import physical_chunks, poisson_loader

SAMPLES, FEATURES, CLASSES, BATCH, PHYSICAL = 64, 6, 3, 16, 5


def build():
    """Model, optimizer, engine, loader and the loader's generator, all from fixed seeds."""
    data_gen = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, FEATURES, generator=data_gen)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=data_gen)
    torch.manual_seed(7)  # the initialisation
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ReproducibleNoiseWarning: wanted here
        engine = pe.PrivacyEngine(model, batch_size=BATCH, sample_size=SAMPLES, max_grad_norm=1.0,
                                  noise_multiplier=1.3, accountant="rdp",
                                  noise_generator=torch.Generator().manual_seed(1234))
    engine.attach(optimizer)
    loader_gen = torch.Generator().manual_seed(99)
    loader = poisson_loader(TensorDataset(x, y), BATCH, generator=loader_gen)
    return model, optimizer, engine, loader, loader_gen


def kill_during_save():
    """Replace torch.save by one that writes half of the checkpoint's bytes and dies."""
    real_save = torch.save

    def half_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half_save


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-in-save", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, optimizer, engine, loader, loader_gen = build()
    epoch, batch_start, chunk_start, physical, epoch_state = 0, 0, 0, 0, None
    if args.resume:
        extra = pe.load_checkpoint(args.ckpt, model=model, optimizer=optimizer, engine=engine)
        epoch, batch_start, chunk_start = extra["epoch"], extra["batch"], extra["chunk"]
        physical, epoch_state = extra["physical"], extra["loader_state"]
        print(f"RESUMED PHYSICAL {physical} STEP {engine.steps_taken}", flush=True)

    def per_sample_loss(x, y):
        return F.cross_entropy(model(x), y, reduction="none")

    while engine.steps_taken < args.steps:
        if epoch_state is None:
            epoch_state = loader_gen.get_state()  # the epoch's batches follow from this state
        else:
            loader_gen.set_state(epoch_state)  # resumed: draw the epoch's batches again
        for b, (x, y) in enumerate(loader):
            if b < batch_start:
                continue  # done before the checkpoint
            chunks = list(physical_chunks((x, y), PHYSICAL)) or [None]  # None: an empty batch
            for c in range(chunk_start, len(chunks)):
                last = c + 1 == len(chunks)
                if chunks[c] is None:
                    optimizer.step(loss=torch.zeros(0))
                elif last:
                    optimizer.step(loss=per_sample_loss(*chunks[c]))
                else:
                    optimizer.virtual_step(loss=per_sample_loss(*chunks[c]))
                if last:
                    optimizer.zero_grad(set_to_none=True)
                physical += 1
                position = (b + 1, 0) if last else (b, c + 1)
                extra = {"loader_state": epoch_state, "epoch": epoch, "batch": position[0],
                         "chunk": position[1], "physical": physical}
                if physical == args.kill_in_save:
                    kill_during_save()
                pe.save_checkpoint(args.ckpt, model=model, optimizer=optimizer, engine=engine,
                                   extra=extra)
                print(f"PHYSICAL {physical} STEP {engine.steps_taken} ACCUMULATING {int(not last)}"
                      f" EPOCH {epoch} BATCH {b}", flush=True)
                if physical == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if engine.steps_taken >= args.steps:
                    break
            chunk_start = 0
            if engine.steps_taken >= args.steps:
                break
        epoch, batch_start, epoch_state = epoch + 1, 0, None

    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "epsilon": engine.get_epsilon(), "steps": engine.steps_taken,
                "physical": physical}, args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
