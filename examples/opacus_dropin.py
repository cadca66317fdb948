#!/usr/bin/env python
"""An Opacus training script in which only the import changed.

    - from opacus import PrivacyEngine
    + from private_engine.opacus_compat import PrivacyEngine

Everything below is the usual Opacus 1.6 recipe: make_private with Poisson sampling, the plain
``loss.backward(); optimizer.step(); optimizer.zero_grad()`` loop, BatchMemoryManager for a
logical batch larger than the physical one, ``get_epsilon``, and a checkpoint. Small synthetic
data so it runs in seconds on a CPU:

    python examples/opacus_dropin.py [--epochs 2] [--grad-sample-mode hooks|ghost] \\
        [--accountant prv]
"""
import argparse
import os
import tempfile
import warnings

import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from private_engine.opacus_compat import PrivacyEngine  # was: from opacus import PrivacyEngine

warnings.filterwarnings("ignore", message="Secure RNG turned off")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--grad-sample-mode", default="hooks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--accountant", default="prv", choices=("prv", "rdp", "gdp"))
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    n, classes = args.samples, 4
    centers = torch.randn(classes, 2, 8, 8) * 2
    y = torch.randint(0, classes, (n,))
    x = centers[y] + torch.randn(n, 2, 8, 8)
    train_loader = DataLoader(TensorDataset(x, y), batch_size=64)

    model = nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(8, classes),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    privacy_engine = PrivacyEngine(accountant=args.accountant)
    out = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=train_loader, criterion=criterion,
        target_epsilon=8.0, target_delta=1e-5, epochs=args.epochs, max_grad_norm=1.0,
        grad_sample_mode=args.grad_sample_mode,
    )
    if len(out) == 4:  # ghost modes also return the wrapped criterion
        model, optimizer, criterion, train_loader = out
    else:
        model, optimizer, train_loader = out
    print(f"noise multiplier σ = {optimizer.noise_multiplier:.3f}")

    for epoch in range(args.epochs):
        model.train()
        with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=32,
                                optimizer=optimizer) as loader:
            for xb, yb in loader:
                loss = criterion(model(xb), yb)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            acc = (model(x).argmax(1) == y).float().mean().item()
        print(f"epoch {epoch + 1}: loss {loss.item():.3f}, train accuracy {acc:.3f}, "
              f"ε = {privacy_engine.get_epsilon(1e-5):.2f}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        privacy_engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
        privacy_engine.load_checkpoint(path=path, module=model, optimizer=optimizer)
    return acc, privacy_engine.get_epsilon(1e-5)


if __name__ == "__main__":
    main()
