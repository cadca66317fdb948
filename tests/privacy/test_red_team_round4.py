"""Red-team round 4: the shared-row broadcast of Hugging Face's default ``position_ids``, compiled
and scripted parts of a step, crafted samples against the new layer rules, and the sampling
check's refusal of batches that are not Poisson, attacked.

Same contract and harness as tests/privacy/test_privacy_under_attack.py: noise 0, SGD at lr 1,
one step with and without the attacker's sample (same other samples, declared batch size B)::

    ratio = B·‖Δ(released)‖ / R  ≤  1 + 1e-6

or both runs refused with a ValueError before anything is released. Every break found here is
fixed (each test failed before its fix; the ratio or what slipped is in its docstring) but one
documented limit (``xfail(strict=True)``); the others are attacks that held, kept as regression
tests.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import private_engine as pe
from private_engine.accounting.sampling_check import SamplingRateError
from test_privacy_under_attack import DOOR_IDS, DOORS, Case, assert_bounded, ratio, run_pair

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore")]

FEW_DOORS = [("native", "bk_mixed"), ("native", "ghost"), ("native", "per_sample"),
             ("opacus", "hooks"), ("opacus", "ghost")]
FEW_DOOR_IDS = [f"{d}-{h}" for d, h in FEW_DOORS]


# -- 1. a clipped layer called on one row, broadcast to the batch --------------------------------
T, V, D = 3, 10, 4


def launder_through_data(ids: torch.Tensor) -> torch.Tensor:
    """A fresh ``(1, T)`` tensor written through its ``.data`` alias with the batch's column-wise
    maximum token: the write lands on an object the batch flow does not follow."""
    z = torch.zeros(1, T, dtype=torch.long)
    z.data.copy_(ids.amax(0, keepdim=True))
    return z


def launder_through_detach(ids: torch.Tensor) -> torch.Tensor:
    """The same write through ``z.detach()`` (an alias that is no view)."""
    z = torch.zeros(1, T, dtype=torch.long)
    z.detach().copy_(ids.amax(0, keepdim=True))
    return z


#: how the row given to the position Embedding is made: name -> f(ids) -> (1, T) or (n, T)
POSITION_ROWS = {
    "hf_default": lambda ids: torch.arange(T)[None],  # Hugging Face's default position_ids
    "first_sample": lambda ids: ids[:1],  # sample 0's tokens as every sample's positions
    "batch_max": lambda ids: ids.amax(0, keepdim=True),  # a batch statistic of one row
    "through_data": launder_through_data,
    "through_detach": launder_through_detach,
}


class PositionModel(nn.Module):
    """Token and position Embeddings summed, then a Linear head (``(n, T) → (n, T, 2)``); the
    position Embedding is called on ``POSITION_ROWS[how](ids)`` (twice, the second time on the
    reversed row, with ``twice``)."""

    def __init__(self, how: str, twice: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(V, D)
        self.head = nn.Linear(D, 2)
        self.how, self.twice = how, twice

    def forward(self, ids):
        rows = POSITION_ROWS[self.how](ids)
        p = self.pos(rows)
        if self.twice:
            p = p + self.pos(rows.flip(1))
        return self.head(self.tok(ids) + p)


def position_case(how: str, twice: bool = False) -> Case:
    """Three honest token sequences; the attacker's holds the largest token everywhere with
    targets 10⁴ away."""
    g = torch.Generator().manual_seed(1)
    honest = (torch.randint(0, V, (3, T), generator=g), torch.randn(3, T, 2, generator=g))
    crafted = (torch.full((1, T), V - 1), torch.full((1, T, 2), 1e4))
    return Case(PositionModel(how, twice), honest, crafted)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_a_shared_position_row_is_clipped_per_sample(twice, door, how):
    """The default ``position_ids`` row (1, T), used once or twice, is recorded per sample:
    the bound holds (ratio ≤ 1)."""
    case = position_case("hf_default", twice)
    assert_bounded(*run_pair(case, door, how), what=f"hf position row {door}-{how}")


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("row", ["first_sample", "batch_max"])
def test_a_row_of_sample_data_is_not_taken_for_a_shared_row(row, door, how):
    """One row made of the samples' tokens (``ids[:1]``, ``ids.amax(0, keepdim=True)``) is not
    broadcast as a shared row: the step is refused with and without the attacker's sample."""
    case = position_case(row)
    assert_bounded(*run_pair(case, door, how), may_refuse=True, refuse_at="step",
                   what=f"{row} {door}-{how}")


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("row", ["through_data", "through_detach"])
def test_a_laundered_batch_row_is_not_taken_for_a_shared_row(row, door, how):
    """``z = zeros(1, T); z.data.copy_(ids.amax(0, keepdim=True))`` (or ``z.detach().copy_``):
    the copy tags the alias object, ``z`` itself has no entry, so ``BatchFlow._entry`` never
    compares it with the write (``_writes`` is read only for tensors that have an entry) and
    ``broadcast_rows`` takes it for a row of no sample's data. Every honest sample's position
    gradient then moves with the attacker's tokens: ratio 1.278 in every mode and door."""
    case = position_case(row)
    assert_bounded(*run_pair(case, door, how), may_refuse=True, what=f"{row} {door}-{how}")


class CentredByAlias(nn.Module):
    """``Embedding → + 100·(the batch mean of the activations, copied into a fresh (1, T, D)
    tensor through its .data alias) → Linear``: no layer is called on the laundered row."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.head = nn.Embedding(V, D), nn.Linear(D, 2)

    def forward(self, ids):
        h = self.tok(ids)
        z = torch.zeros(1, T, D)
        z.data.copy_(h.detach().mean(0, keepdim=True))
        return self.head(h + 100 * z)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_a_batch_mean_written_through_a_data_alias(door, how):
    """The same laundering without the broadcast: the batch mean reaches every sample's
    activations as a constant; ratio 1.934 in every mode and door."""
    case = position_case("hf_default")
    case = Case(CentredByAlias(), case.honest, case.crafted)
    assert_bounded(*run_pair(case, door, how), may_refuse=True, what=f"data alias {door}-{how}")


class ShapeReadingModel(PositionModel):
    """``PositionModel`` with the default position row, whose code reads the shape of the
    position Embedding's output ``q`` (1, T, D): ``q / q.shape[0]`` ("divide"), ``q.reshape(1, T,
    D)`` ("reshape"), ``q.squeeze(0)`` ("squeeze"), ``q[0]`` ("first")."""

    def __init__(self, use: str):
        super().__init__("hf_default")
        self.use = use

    def forward(self, ids):
        q = self.pos(torch.arange(T)[None])
        p = {"divide": lambda: q / q.shape[0], "reshape": lambda: q.reshape(1, T, D),
             "squeeze": lambda: q.squeeze(0), "first": lambda: q[0]}[self.use]()
        return self.head(self.tok(ids) + p)


def shape_case(use: str) -> Case:
    case = position_case("hf_default")
    return Case(ShapeReadingModel(use), case.honest, case.crafted)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("use", ["squeeze", "first"])
def test_code_reading_the_shared_rows_shape(use, door, how):
    """``q.squeeze(0)`` keeps its values (bounded); ``q[0]`` selects one row of the broadcast
    batch and is refused with and without the attacker's sample."""
    assert_bounded(*run_pair(shape_case(use), door, how), may_refuse=True,
                   what=f"{use} {door}-{how}")


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_the_broadcast_output_shape_carries_the_batch_size(door, how):
    """``q / q.shape[0]`` divides by 1 in the model's own forward and by n under the engine
    (``Recorder._record_call`` returns ``output.expand(n, …)``): the forward is no longer the
    model's, and its values depend on how many samples the batch holds, which the attacker's
    presence changes. Ratio 1.087 in every mode and door."""
    assert_bounded(*run_pair(shape_case("divide"), door, how), may_refuse=True,
                   what=f"divide {door}-{how}")


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="documented limit: q.reshape(1, T, D) of the expanded shared row fails "
                   "in torch's shape check, before the op reaches the batch flow: torch's "
                   "RuntimeError, with or without the sample, nothing released")
def test_reshaping_the_shared_row_is_refused_naming_the_layer():
    """``q.reshape(1, T, D)``, valid in the model's own forward, raises ``RuntimeError: shape
    '[1, 3, 4]' is invalid for input of size 48`` under the engine: the step fails, with no
    word of the broadcast nor of the layer."""
    assert_bounded(*run_pair(shape_case("reshape"), "native", "bk_mixed"), may_refuse=True,
                   what="reshape native-bk_mixed")


# -- 2. scripted, compiled and compiler-disabled parts of the step -------------------------------
def batch_mean(h):
    return h.mean(0)


def _scripted_batch_mean(h: torch.Tensor) -> torch.Tensor:
    return h.mean(0)


with warnings.catch_warnings():  # torch.jit.script is deprecated, still in use
    warnings.simplefilter("ignore")
    scripted_batch_mean = torch.jit.script(_scripted_batch_mean)


_compiled_mean = torch.compile(batch_mean, backend="aot_eager")

#: how a batch statistic (not of the batch's size, so the unseen-value refusal cannot fire) is made
STATISTICS = {
    "jit_script": scripted_batch_mean,
    "compiler_disable": torch.compiler.disable(batch_mean),
    "compile_aot_eager": lambda h: _compiled_mean(h),
}


class CentredBy(nn.Module):
    """``Linear(8, 6) → h − 3·stat(h) → Linear(6, 4)`` with a batch statistic ``stat``."""

    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.how = nn.Linear(8, 6), nn.Linear(6, 4), how

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h - 3 * STATISTICS[self.how](h))


@pytest.mark.parametrize("door,how", FEW_DOORS, ids=FEW_DOOR_IDS)
@pytest.mark.parametrize("stat", list(STATISTICS))
def test_a_batch_statistic_computed_outside_eager_python_is_refused(stat, door, how):
    """A batch mean computed by a TorchScript function, under ``torch.compiler.disable`` or by a
    compiled function (aot_eager) still runs through the dispatcher: refused in both runs."""
    g = torch.Generator().manual_seed(1)
    case = Case(CentredBy(stat), (torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)),
                (torch.full((1, 8), 100.0), torch.zeros(1, 4)))
    assert_bounded(*run_pair(case, door, how), may_refuse=True, refuse_at="step",
                   what=f"{stat} {door}-{how}")


# -- 3. the new layer rules: crafted settings not covered by test_new_layers_under_attack --------
def _tiny_v_weight_norm() -> nn.Module:
    """weight_norm whose direction ``v`` has rows of 1e-15 and 1e-19 (‖v‖² near the subnormals)."""
    torch.manual_seed(0)
    m = nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        v = m[0].parametrizations.weight.original1
        v[0].mul_(1e-15)
        v[1].mul_(1e-19)
    return m


LAYERS = {
    "rmsnorm_eps_none_first": lambda: nn.Sequential(nn.RMSNorm(4, eps=None), nn.Linear(4, 3)),
    "instancenorm_first": lambda: nn.Sequential(nn.InstanceNorm1d(2, affine=True, eps=1e-12),
                                                nn.Conv1d(2, 3, 1)),
    "conv_transpose_dilated_grouped": lambda: nn.Sequential(nn.ConvTranspose2d(
        2, 4, 3, stride=(2, 3), padding=(1, 0), output_padding=(1, 2), dilation=(2, 1),
        groups=2)),
    "weight_norm_tiny_v": _tiny_v_weight_norm,
}
SHAPES = {"conv_transpose_dilated_grouped": (2, 3, 2)}
#: crafted inputs: a constant row (zero variance), subnormal, huge of alternating sign
INPUTS = {
    "constant": lambda s: torch.full(s, 7.0),
    "subnormal": lambda s: torch.full(s, 1.4e-45),
    "huge": lambda s: torch.full(s, 1e30) * (torch.arange(s[-1]) % 2 * 2 - 1).float(),
}


@pytest.mark.parametrize("door,how", FEW_DOORS, ids=FEW_DOOR_IDS)
@pytest.mark.parametrize("inp", list(INPUTS))
@pytest.mark.parametrize("layer", list(LAYERS))
def test_new_layer_rules_on_degenerate_samples(layer, inp, door, how):
    """RMSNorm(eps=None) and affine InstanceNorm as the first layer (a zero-variance or subnormal
    row reaches the norm), a dilated grouped ConvTranspose2d with unequal strides, and weight_norm
    with direction rows of 1e-15 and 1e-19, on a sample with targets 10⁴ away: ratio ≤ 1."""
    torch.manual_seed(0)
    model = LAYERS[layer]()
    shape = (1, *SHAPES.get(layer, (2, 4)))
    g = torch.Generator().manual_seed(1)
    x_honest = torch.randn(3, *shape[1:], generator=g) * 0.3
    with torch.no_grad():
        t_honest = model(x_honest) + 0.02 * torch.randn(model(x_honest).shape, generator=g)
        x = INPUTS[inp](shape)
        y = model(x)
    t = y.nan_to_num(0.0, 0.0, 0.0) + 1e4 * torch.randn(y.shape, generator=g)
    case = Case(model, (x_honest, t_honest), (x, t))
    assert_bounded(*run_pair(case, door, how), may_refuse=True, what=f"{layer} {inp} {door}-{how}")


# -- 4. the sampling check: loaders that are not Poisson -----------------------------------------
def _engine(**kw):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=1.0, epochs=100, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    return model, opt


def _steps_released(model, opt, batches) -> int:
    """Step every batch of inputs; the number released before a SamplingRateError."""
    released = 0
    try:
        for x in batches:
            opt.step(loss=(model(x) ** 2).sum(1))
            opt.zero_grad()
            released += 1
    except SamplingRateError:
        pass
    return released


def test_a_fixed_size_loader_is_refused_at_construction():
    """``DataLoader(batch_size=B)`` given to the engine is refused when it is built."""
    loader = DataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4, shuffle=True)
    with pytest.raises(SamplingRateError):
        _engine(data_loader=loader)


class FixedBatches(torch.utils.data.IterableDataset):
    """Shuffled batches of exactly 4 of 40 rows, yielded already batched (no ``__len__``)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __iter__(self):
        order = torch.randperm(len(self.rows))
        return iter((self.rows[order[i:i + 4]],) for i in range(0, len(self.rows), 4))


def _fixed_size_loader(kind: str) -> DataLoader:
    rows = torch.randn(40, 3)
    if kind == "batch_sampler":
        data = TensorDataset(rows)
        return DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, drop_last=True))
    return DataLoader(FixedBatches(rows), batch_size=None)


@pytest.mark.parametrize("kind", ["batch_sampler", "iterable"])
def test_a_fixed_size_loader_of_another_form_is_refused_before_any_release(kind):
    """The same fixed-size batches through ``batch_sampler=BatchSampler(RandomSampler, 4)``
    (``loader.batch_size`` is None, the sampler's ``batch_size`` is 4) or an IterableDataset
    yielding batches of 4 (``batch_size=None``): the engine given this loader is built, and 16
    steps of B = 4, n = 40 are released before the count check (``P(Binomial(k, p₀) ≥ k) <
    10⁻¹¹``) refuses one."""
    loader = _fixed_size_loader(kind)
    try:
        model, opt = _engine(data_loader=loader)
    except (SamplingRateError, ValueError):
        return
    released = _steps_released(model, opt, (x for _ in range(10) for (x,) in loader))
    assert released == 0, f"{released} fixed-size steps released before the refusal"


def test_the_pld_accountant_bounds_the_exact_epsilon():
    """``accountant="pld"`` without subsampling (q = 1, 3 steps, σ = 0.8): the exact ε at
    δ = 10⁻⁵ is the Gaussian mechanism's with ``μ = √3/σ`` (Balle & Wang 2018, "Improving the
    Gaussian Mechanism for Differential Privacy"), 11.0278948707; the PLD's ε is an upper bound
    of it, within 10⁻³."""
    from private_engine.accounting.pld import pld_epsilon
    eps = pld_epsilon([(0.8, 1.0, 3)], 1e-5)
    assert 11.0278948707 <= eps <= 11.0278948707 + 1e-3


def test_batch_sizes_without_poisson_dispersion_are_refused():
    """Batches of 5 and 3 samples in turn (declared B = 4, n = 40): the mean is B and no batch
    holds exactly B, so 300 steps are released, though the sizes' variance is 1 where Poisson
    sampling gives ``B(1 − q) = 3.6`` (a dispersion test refuses them within a few dozen
    steps)."""
    model, opt = _engine()
    g = torch.Generator().manual_seed(0)
    batches = (torch.randn(5 if k % 2 == 0 else 3, 3, generator=g) for k in range(300))
    released = _steps_released(model, opt, batches)
    assert released < 300, "300 steps of non-Poisson batch sizes released, none refused"


# -- 5. what DPTrainer logs and checkpoints besides ε ---------------------------------------------
def _pad(features):
    """Right padding to the longest sequence, labels −100 at the padding."""
    T = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), T, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_dp_trainer_says_its_logged_loss_is_not_private(tmp_path):
    """The ``loss`` DPTrainer logs, and writes into every checkpoint's ``trainer_state.json``,
    is the exact mean of the private batch's per-sample losses (σ = 1 noise on the update does
    not reach it; one sample moves it without bound), while the "Logs" bullet of
    docs/transformers.md names ε only. Holds once the docs say the logged loss is not private
    (as docs/engine.md, "Logging and monitoring", says of the step metrics)."""
    transformers = pytest.importorskip("transformers")
    from private_engine.integrations.losses import per_sample_loss
    from private_engine.integrations.transformers import DPTrainer, PrivacyArguments
    cfg = transformers.GPT2Config(vocab_size=20, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(1, 20, (int(k),), generator=g).tolist()}
            for k in (4, 6, 5, 7)]
    batch = _pad(data)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        exact = float(per_sample_loss(logits, batch["labels"], causal=True).mean())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="sgd", learning_rate=1.0,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        save_strategy="steps", save_steps=1, logging_steps=1, disable_tqdm=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=_pad,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, max_grad_norm=1.0,
                                                      poisson_sampling=False))
    trainer.train()
    state = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    logged = next(h["loss"] for h in state["log_history"] if "loss" in h)
    assert abs(logged - exact) < 1e-3, (logged, exact)  # the batch's exact mean loss
    doc = (Path(__file__).parents[2] / "docs" / "transformers.md").read_text()
    logs = next(b for b in doc.split("\n- ") if b.startswith("**Logs.**"))
    assert "not private" in logs.lower(), f"logged loss {logged} = exact {exact:.4f}; {logs!r}"


# -- 6. DPCallback: what a Lightning training_step may return -----------------------------------
def _lightning_update(how: str, rows):
    """One Lightning step (DPCallback, noise 0, SGD lr 1, declared B = 4) of a module whose
    ``training_step`` computes the per-sample squared errors on the data set's ``rows`` (row 3:
    the attacker's, 100 everywhere): the update, or the refusal's message."""
    import tempfile

    pl = pytest.importorskip("lightning.pytorch")
    from private_engine.integrations.lightning import DPCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))

        def training_step(self, batch, i):
            x, y = batch
            if how == "centred_in_step":  # submodules called from training_step, not forward
                h = self.net[0](x)
                out = self.net[1](h - 3 * h.mean(0, keepdim=True))
            else:
                out = self.net(x)
            losses = ((out - y) ** 2).sum(1)
            if how == "detached":
                return losses.detach()
            if how == "loss_plus_mean":
                return losses + 3 * losses.mean()
            return losses

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    x[3], y[3] = 100.0, 0.0
    module = Module()
    before = [p.detach().clone() for p in module.parameters()]
    loader = DataLoader(TensorDataset(x, y), batch_sampler=[rows])
    callback = DPCallback(noise_multiplier=0.0, max_grad_norm=1.0, batch_size=4)
    with tempfile.TemporaryDirectory() as folder:
        trainer = pl.Trainer(callbacks=[callback], accelerator="cpu", devices=1, max_steps=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=folder)
        try:
            trainer.fit(module, train_dataloaders=loader)
        except ValueError as e:
            return str(e)
    return [(p.detach() - b).double() for p, b in zip(module.parameters(), before)]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("how", ["plain", "centred_in_step", "detached", "loss_plus_mean"])
def test_lightning_training_step_under_attack(how):
    """The attacker's row moves a plain step by at most R; a batch mean taken in
    ``training_step`` (outside ``forward``), a detached loss vector and a loss vector plus its
    batch mean are refused with and without the attacker's row."""
    with_run, without_run = (_lightning_update(how, [0, 1, 2, 3]),
                             _lightning_update(how, [0, 1, 2]))
    if how == "plain":
        assert ratio(with_run, without_run) <= 1 + 1e-6
    else:
        assert isinstance(with_run, str) and isinstance(without_run, str), how


# -- 7. a batch-1 row kept in a buffer; DPTrainer's per-sample LM loss on crafted samples --------
class BufferRow(PositionModel):
    """``PositionModel`` whose position row is a registered buffer (1, T) rewritten in the
    forward with the batch's column-wise maximum token, through ``copy_``, ``.data`` or
    ``.detach()``."""

    def __init__(self, write: str):
        super().__init__("hf_default")
        self.register_buffer("row", torch.zeros(1, T, dtype=torch.long))
        self.write = write

    def forward(self, ids):
        target = {"copy_": self.row, "data": self.row.data, "detach": self.row.detach()}
        target[self.write].copy_(ids.amax(0, keepdim=True))
        return self.head(self.tok(ids) + self.pos(self.row))


@pytest.mark.parametrize("door,how", FEW_DOORS, ids=FEW_DOOR_IDS)
@pytest.mark.parametrize("write", ["copy_", "data", "detach"])
def test_a_buffer_row_written_from_the_batch_is_refused(write, door, how):
    """Unlike a fresh tensor, a buffer rewritten from the batch is caught (state guard or batch
    flow) in both runs."""
    case = position_case("hf_default")
    case = Case(BufferRow(write), case.honest, case.crafted)
    assert_bounded(*run_pair(case, door, how), may_refuse=True, refuse_at="step",
                   what=f"buffer {write} {door}-{how}")


def _lm_loss(y, t):
    from private_engine.integrations.losses import token_mean_loss
    return token_mean_loss(y, t, shift=True)


#: (input, labels) of the attacker's sequence of 4 positions of 5 features (vocabulary 7)
LM_SAMPLES = {
    "all_ignored_huge": (torch.full((1, 4, 5), 1e30), torch.full((1, 4), -100)),
    "one_label_huge": (torch.full((1, 4, 5), 1e30) * torch.tensor([1., -1, 1, -1, 1]),
                       torch.tensor([[-100, -100, -100, 3]])),
    "nan_all_ignored": (torch.full((1, 4, 5), float("nan")), torch.full((1, 4), -100)),
    "inf_input": (torch.full((1, 4, 5), float("inf")), torch.tensor([[1, 2, 3, 4]])),
    "float32_max": (torch.full((1, 4, 5), 3e38), torch.tensor([[0, 1, 2, 3]])),
}


@pytest.mark.parametrize("door,how", FEW_DOORS[:4], ids=FEW_DOOR_IDS[:4])
@pytest.mark.parametrize("sample", list(LM_SAMPLES))
def test_the_per_sample_lm_loss_on_crafted_sequences(sample, door, how):
    """``token_mean_loss`` (shifted) of ``Linear → Tanh → Linear(V)`` on a sequence whose
    labels are all −100, with one label and huge logits, NaN or inf inputs, float32's largest
    inputs: ratio ≤ 1 (the non-finite ones are dropped)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 7))
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(3, 4, 5, generator=g), torch.randint(0, 7, (3, 4), generator=g)
    t[0, 3] = -100
    case = Case(model, (x, t), LM_SAMPLES[sample], loss=_lm_loss)
    assert_bounded(*run_pair(case, door, how), what=f"{sample} {door}-{how}")
