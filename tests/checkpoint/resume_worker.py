"""A small DP training run that checkpoints between logical batches and can kill itself: the
subprocess of tests/checkpoint/test_native_checkpoint.py.

Two set-ups:

* reproducible (default): a 2-layer MLP on 64 random samples, Poisson batches of expected size 16
  (4 per epoch) from a seeded generator, split into physical batches of 5 (``virtual_step`` on all
  but the last, ``step`` on the last), Adam, noise from a seeded ``noise_generator`` (its state is
  checkpointed). ``extra`` holds the loader generator's state at the start of the epoch and the
  position in it, so a resumed run sees the same batches.
* ``--secret``: what a deployment runs and an attacker watches: the engine's default noise
  (entropy-seeded), the default ``poisson_loader`` (fresh batches in every process), SGD, a linear
  map without bias on inputs of size 1e-4, so that each released update is all noise but a tiny
  data term; ``extra`` holds no secret (the epoch position only).

Each physical batch but a logical batch's last tries ``save_checkpoint`` to ``<ckpt>.mid``, which
must be refused (the accumulation in progress is not noised). After every ``optimizer.step()``
the parameters are written to ``<iterates>/<tag>_<u>.pt`` (u: updates of the model since its
initialisation; what an observer of the run sees), a checkpoint is saved if ``u`` is a multiple
of ``--every``, and one line goes to stdout:
``UPDATE <u> STEPS <steps counted> EPOCH <e> BATCH <b> REFUSED <r>``.

    python resume_worker.py --ckpt C --out O --updates N [--secret] [--every E] [--kill-at K]
        [--kill-in-save K] [--resume] [--iterates DIR --tag T]

``--kill-at K``: SIGKILL itself right after update K (after its checkpoint, if it has one).
``--kill-in-save K``: SIGKILL itself halfway through writing the checkpoint of update K
(``torch.save`` replaced by one that writes half of the bytes, flushes, fsyncs and kills the
process). ``--resume``: start from the checkpoint. At the end: the parameters and ε to ``O``.
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
#: the --secret run: a linear map of SECRET_IN·SECRET_OUT coordinates, SGD at SECRET_LR
SECRET_IN, SECRET_OUT, SECRET_LR, SIGMA, R = 32, 16, 0.5, 1.3, 1.0


def build(secret: bool):
    """Model, optimizer, engine, loader and the loader's generator (None in the secret run)."""
    data_gen = torch.Generator().manual_seed(11)
    torch.manual_seed(7)  # the initialisation
    if secret:
        x = 1e-4 * torch.randn(SAMPLES, SECRET_IN, generator=data_gen)
        y = torch.randint(0, SECRET_OUT, (SAMPLES,), generator=data_gen)
        model = nn.Linear(SECRET_IN, SECRET_OUT, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=SECRET_LR)
        engine = pe.PrivacyEngine(model, batch_size=BATCH, sample_size=SAMPLES, max_grad_norm=R,
                                  noise_multiplier=SIGMA, accountant="rdp")
        engine.attach(optimizer)
        return model, optimizer, engine, poisson_loader(TensorDataset(x, y), BATCH), None
    x = torch.randn(SAMPLES, FEATURES, generator=data_gen)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=data_gen)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ReproducibleNoiseWarning: wanted here
        engine = pe.PrivacyEngine(model, batch_size=BATCH, sample_size=SAMPLES, max_grad_norm=R,
                                  noise_multiplier=SIGMA, accountant="rdp",
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
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--secret", action="store_true")
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-in-save", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--iterates", default=None)
    parser.add_argument("--tag", default="run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, optimizer, engine, loader, loader_gen = build(args.secret)
    epoch, batch_start, updates, epoch_state, refused = 0, 0, 0, None, 0
    if args.resume:
        extra = pe.load_checkpoint(args.ckpt, model=model, optimizer=optimizer, engine=engine)
        epoch, batch_start, updates = extra["epoch"], extra["batch"], extra["updates"]
        epoch_state = extra.get("loader_state")
        print(f"RESUMED UPDATE {updates} STEPS {engine.steps_taken}", flush=True)

    def per_sample_loss(x, y):
        return F.cross_entropy(model(x), y, reduction="none")

    def save(extra, path=args.ckpt):
        pe.save_checkpoint(path, model=model, optimizer=optimizer, engine=engine, extra=extra)

    while updates < args.updates:
        if loader_gen is not None:
            if epoch_state is None:
                epoch_state = loader_gen.get_state()  # the epoch's batches follow from it
            else:
                loader_gen.set_state(epoch_state)  # resumed: draw the epoch's batches again
        for b, (x, y) in enumerate(loader):
            if b < batch_start:
                continue  # done before the checkpoint (reproducible run)
            chunks = list(physical_chunks((x, y), PHYSICAL)) or [None]  # None: an empty batch
            for c, chunk in enumerate(chunks):
                if chunk is None:
                    optimizer.step(loss=torch.zeros(0))
                elif c + 1 < len(chunks):
                    optimizer.virtual_step(loss=per_sample_loss(*chunk))
                    try:
                        save({}, args.ckpt + ".mid")  # must not be written
                    except ValueError:
                        refused += 1  # an accumulation in progress is never written
                else:
                    optimizer.step(loss=per_sample_loss(*chunk))
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            if args.iterates:
                flat = torch.cat([p.detach().flatten() for p in model.parameters()])
                torch.save(flat, os.path.join(args.iterates, f"{args.tag}_{updates}.pt"))
            if updates % args.every == 0:
                extra = {"epoch": epoch, "batch": b + 1, "updates": updates}
                if loader_gen is not None:
                    extra["loader_state"] = epoch_state
                if updates == args.kill_in_save:
                    kill_during_save()
                save(extra)
            print(f"UPDATE {updates} STEPS {engine.steps_taken} EPOCH {epoch} BATCH {b} "
                  f"REFUSED {refused}", flush=True)
            if updates == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if updates >= args.updates:
                break
        epoch, batch_start, epoch_state = epoch + 1, 0, None

    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "epsilon": engine.get_epsilon(), "steps": engine.steps_taken,
                "updates": updates}, args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
