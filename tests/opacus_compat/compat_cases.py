"""Shared by the tests/opacus_compat/ modules: tiny float64 models, their data, the Opacus
training loop run with either engine (``train``) and its comparison (``assert_same_run``), and
``make_compat`` (``make_private`` of the Opacus-compatible engine with small defaults)."""
from __future__ import annotations

import opacus
import pytest
import torch
from opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from private_engine import opacus_compat

TOL = 1e-5


# -- models (float64, tiny) ------------------------------------------------------------------------
class TextLSTM(nn.Module):
    def __init__(self, vocab=20, emb=6, hidden=5, classes=3, rnn=DPLSTM):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = rnn(emb, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.fc(h[:, -1])


class TinyMHA(nn.Module):
    def __init__(self, dim=8, classes=3, add_bias_kv=False):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.attn = DPMultiheadAttention(dim, 2, batch_first=True, add_bias_kv=add_bias_kv)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h)
        return self.fc(a.mean(1))


class SeqFirstText(nn.Module):
    """Every layer but the LSTM's per-step linear maps sees (T, B, ·): for
    make_private(batch_first=False)."""

    def __init__(self, vocab=20, emb=6, hidden=5, classes=3, add_bias_kv=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = DPLSTM(emb, hidden, batch_first=False)
        self.attn = DPMultiheadAttention(hidden, 1, batch_first=False, add_bias_kv=add_bias_kv)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):  # x: (B, T) from the loader
        h, _ = self.lstm(self.emb(x.t()))
        h, _ = self.attn(h, h, h)
        return self.fc(h)[-1]


def mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def cnn_gn():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, stride=2), nn.Flatten(), nn.Linear(4 * 2 * 2, 3))


def vit():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=4, depth=1,
                              embed_dim=8, num_heads=2, num_classes=3)
    model.cls_token.requires_grad_(False)  # rules for these come from another branch
    model.pos_embed.requires_grad_(False)
    return model


def data_for(name, n=24):
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (n,), generator=g)
    if name == "mlp":
        x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    elif name == "cnn_gn":
        x = torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64)
    elif name in ("lstm", "gru", "rnn", "seq_first", "seq_first_bias_kv"):
        x = torch.randint(0, 20, (n, 5), generator=g)
    elif name == "vit":
        x = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
    else:  # mha, mha_bias_kv
        x = torch.randn(n, 4, 4, generator=g, dtype=torch.float64)
    return x, y


MODELS = {"mlp": mlp, "cnn_gn": cnn_gn, "lstm": TextLSTM, "vit": vit, "mha": TinyMHA,
          "gru": lambda: TextLSTM(rnn=DPGRU), "rnn": lambda: TextLSTM(rnn=DPRNN),
          "seq_first": SeqFirstText, "seq_first_bias_kv": lambda: SeqFirstText(add_bias_kv=True),
          "mha_bias_kv": lambda: TinyMHA(add_bias_kv=True)}


def train(engine_cls, name, *, mode="hooks", reduction="mean", noise=1.0, clipping="flat", steps=3,
          batch_size=8, poisson=False, momentum=0.0, physical=None, R=None, own_criterion=False,
          dtype=torch.float64, wrap_model=True, batch_first=True, clip_gamma=None,
          rand_on_empty=False):
    """Run the Opacus loop; return (flat parameters, ε at δ=1e-5, engine)."""
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    x, y = data_for(name)
    x = x.to(dtype) if x.is_floating_point() else x
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    if R is None:
        R = 0.1 if clipping == "flat" else [0.05] * n_params
    engine = engine_cls(accountant="rdp")
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    out = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                              noise_multiplier=noise, max_grad_norm=R, loss_reduction=reduction,
                              poisson_sampling=poisson, grad_sample_mode=mode, criterion=criterion,
                              clipping=clipping, noise_generator=torch.Generator().manual_seed(7),
                              wrap_model=wrap_model, batch_first=batch_first,
                              rand_on_empty=rand_on_empty)
    if len(out) == 4:
        module, optimizer, wrapped, loader = out
        criterion = criterion if own_criterion else wrapped
    else:
        module, optimizer, loader = out
    if not wrap_model:
        module = model  # the returned object only holds the hooks
    scheduler = None
    # Opacus' grad-clip scheduler changes optimizer.max_grad_norm every step
    if clip_gamma is not None:
        from opacus.schedulers import ExponentialGradClip
        scheduler = ExponentialGradClip(optimizer, gamma=clip_gamma)
    torch.manual_seed(3)  # Poisson sampling draws from the global generator
    done, sizes = 0, []
    while done < steps:
        if physical:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical,
                                    optimizer=optimizer) as mem_loader:
                for xb, yb in mem_loader:
                    sizes.append(len(yb))
                    loss = criterion(module(xb), yb)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            done = steps
            continue
        for xb, yb in loader:
            if done >= steps:
                break
            sizes.append(len(yb))
            loss = criterion(module(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
            done += 1
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    eps = engine.get_epsilon(1e-5) if noise > 0 else 0.0
    return flat, eps, engine, sizes


def assert_same_run(name, **kw):
    a, eps_a, _, sizes_a = train(opacus.PrivacyEngine, name, **kw)
    b, eps_b, engine, sizes_b = train(opacus_compat.PrivacyEngine, name, **kw)
    assert isinstance(engine, opacus_compat.PrivacyEngine)
    assert sizes_a == sizes_b
    diff = (a - b).abs().max().item()
    assert diff < TOL, f"{name} {kw}: parameters differ by {diff:.2e}"
    assert eps_a == eps_b
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten()
                       for p in MODELS[name]().to(kw.get("dtype", torch.float64)).parameters()])
    assert (b - start).abs().max().item() > 100 * TOL  # training moved the parameters
    return sizes_b


def make_compat(model=None, **kw):
    model = model if model is not None else mlp().double()
    x, y = data_for("mlp", n=8)
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0,
                max_grad_norm=1.0)
    args.update(kw)
    return opacus_compat.PrivacyEngine().make_private(**args)
