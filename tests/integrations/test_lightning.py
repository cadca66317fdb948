"""DPCallback: Lightning's Trainer with the privacy engine, as Lightning users call it (a
LightningModule whose training_step returns the per-sample losses, a Poisson loader)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from private_engine import BudgetExceededError
from private_engine.accounting.sampling_check import SamplingRateError
from reference import assert_close_rel, reference_clipped_sum

pl = pytest.importorskip("lightning.pytorch")
from private_engine.data import poisson_loader  # noqa: E402
from private_engine.integrations.lightning import DPCallback  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


class Classifier(pl.LightningModule):
    """A two-layer classifier; training_step returns the per-sample losses and records the
    batches it saw."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        return F.cross_entropy(self.net(x), y, reduction="none")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def data(n=16, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(3 * torch.randn(n, 6, generator=g, dtype=dtype),
                         torch.randint(0, 3, (n,), generator=g))


def trainer(tmp_path, callback, **kw):
    base = dict(accelerator="cpu", devices=1, max_steps=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=str(tmp_path))
    base.update(kw)
    return pl.Trainer(callbacks=[callback], **base)


def sample_loss(model, x, y):
    return F.cross_entropy(model.net(x), y, reduction="none")


def test_one_step_is_the_clipped_mean(tmp_path):
    """noise 0, SGD lr 1: the update is −(Σ_i C_i g_i)/B over the drawn Poisson batch, C_i
    from each sample's float64 gradient."""
    R = 0.5
    module, ref_module = Classifier(), Classifier()
    before = [p.detach().clone() for p in module.parameters()]
    callback = DPCallback(noise_multiplier=0.0, max_grad_norm=R)
    trainer(tmp_path, callback).fit(module, train_dataloaders=poisson_loader(data(), 8))
    (x, y), = module.seen
    ref, norms = reference_clipped_sum(ref_module, [x, y], sample_loss, R,
                                       lambda n, r: torch.clamp(r / (n + 1e-6), max=1.0))
    assert float(norms.max()) > R  # some sample is clipped
    delta = [p.detach() - b for p, b in zip(module.parameters(), before)]
    assert_close_rel(delta, [-r / 8 for r in ref], 1e-9)
    assert callback.privacy_report().steps == 1


def test_noisy_run_logs_epsilon_within_target(tmp_path):
    logger = pl.loggers.CSVLogger(str(tmp_path))
    callback = DPCallback(target_epsilon=4.0, max_grad_norm=1.0)
    module = Classifier(torch.float32)
    trainer(tmp_path, callback, max_steps=3, logger=logger, log_every_n_steps=1).fit(
        module, train_dataloaders=poisson_loader(data(32, torch.float32), 8))
    report = callback.privacy_report()
    assert report.steps == 3 and 0 < report.epsilon <= 4.0
    assert report.delta == pytest.approx(1 / 64)
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "epsilon" in logged.splitlines()[0]
    last = [line for line in logged.splitlines()[1:] if line.strip()][-1].split(",")
    header = logged.splitlines()[0].split(",")
    assert float(last[header.index("epsilon")]) == pytest.approx(report.epsilon, rel=1e-6)


def test_checkpoint_holds_the_engine_and_resumes(tmp_path):
    """A checkpoint after step 1 of 2 holds the engine's state; resumed from it, the step ledger
    holds both steps the run released, so the planned budget is spent and the step is refused."""
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1,
                                        save_top_k=-1)
    callback = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
               enable_progress_bar=False, enable_model_summary=False,
               callbacks=[callback, ckpt]).fit(
        Classifier(torch.float32), train_dataloaders=poisson_loader(data(16, torch.float32), 4))
    first = tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    state = torch.load(first, weights_only=False)["private_engine"]
    assert sum(n for _, _, n in state["accountant"]["history"]) == 1
    assert (tmp_path / "ckpt" / "private_engine.ledger").exists()
    eps = callback.privacy_report().epsilon
    again = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(BudgetExceededError):
        pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, callbacks=[again]).fit(
            Classifier(torch.float32),
            train_dataloaders=poisson_loader(data(16, torch.float32), 4), ckpt_path=str(first))
    report = again.privacy_report()
    assert report.steps == 2 and report.epsilon == pytest.approx(eps)


class Fixed(Classifier):
    """Trains on a fixed batch (the whole data set, with or without a crafted sample)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(self.x), self.y, reduction="none")


def test_crafted_huge_sample_moves_the_update_by_at_most_R(tmp_path):
    """noise 0, SGD lr 1: B·‖Δupdate‖/R between a batch with and without a sample of 1e30
    inputs is at most 1."""
    R, B = 0.5, 4
    ds = data(8)
    x, y = ds.tensors
    crafted = torch.full((1, 6), 1e30, dtype=torch.float64)
    updates = []
    for xs, ys in ((x, y), (torch.cat([x, crafted]), torch.cat([y, y[:1]]))):
        module = Fixed(xs, ys)
        before = [p.detach().clone() for p in module.parameters()]
        trainer(tmp_path, DPCallback(noise_multiplier=0.0, max_grad_norm=R, batch_size=B)).fit(
            module, train_dataloaders=poisson_loader(ds, B))
        updates.append(torch.cat([(p.detach() - b).flatten()
                                  for p, b in zip(module.parameters(), before)]))
    ratio = B * float((updates[0] - updates[1]).norm()) / R
    assert 0 < ratio <= 1 + 1e-9


@pytest.mark.parametrize("kw,match", [
    (dict(gradient_clip_val=1.0), "gradient_clip_val"),
    (dict(accumulate_grad_batches=2), "accumulate_grad_batches"),
    (dict(precision="16-true"), "precision"),
])
def test_refuses_what_it_cannot_train_exactly(tmp_path, kw, match):
    callback = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=match):
        trainer(tmp_path, callback, **kw).fit(
            Classifier(torch.float32), train_dataloaders=poisson_loader(data(16, torch.float32), 4))


def test_refuses_fixed_size_batches_a_mean_loss_and_a_skipped_step(tmp_path):
    callback = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(SamplingRateError, match="poisson_loader"):
        trainer(tmp_path, callback).fit(
            Classifier(torch.float32),
            train_dataloaders=DataLoader(data(16, torch.float32), batch_size=4, shuffle=True))

    class Mean(Classifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx).mean()

    with pytest.raises(ValueError, match=r"per-sample losses, shape \(B,\)"):
        trainer(tmp_path, DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)).fit(
            Mean(torch.float32), train_dataloaders=poisson_loader(data(16, torch.float32), 4))

    class Skipping(Classifier):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(ValueError, match="returned None"):
        trainer(tmp_path, DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)).fit(
            Skipping(torch.float32), train_dataloaders=poisson_loader(data(16, torch.float32), 4))


def test_refuses_manual_optimization(tmp_path):
    class Manual(Classifier):
        def __init__(self):
            super().__init__(torch.float32)
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic_optimization"):
        trainer(tmp_path, DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)).fit(
            Manual(), train_dataloaders=poisson_loader(data(16, torch.float32), 4))


def test_bf16_mixed_steps_privately(tmp_path):
    module = Classifier(torch.float32)
    before = [p.detach().clone() for p in module.parameters()]
    callback = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer(tmp_path, callback, precision="bf16-mixed").fit(
        module, train_dataloaders=poisson_loader(data(16, torch.float32), 4))
    assert callback.privacy_report().steps == 1
    assert all(not torch.equal(p, b) for p, b in zip(module.parameters(), before))


@pytest.mark.parametrize("kw", [dict(devices=2), dict(devices=1, strategy="ddp")],
                         ids=["two-devices", "ddp"])
def test_refuses_several_devices_and_other_strategies(kw):
    """Checked by the callback's setup (called here directly: fit would start processes)."""
    t = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kw)
    with pytest.raises(ValueError, match="one device in one process"):
        DPCallback(noise_multiplier=1.0, max_grad_norm=1.0).setup(
            t, Classifier(torch.float32), "fit")
