"""Adversarial sensitivity beyond one step's per-sample norms: state, coupling and time.

The measure of ``test_privacy_under_attack`` (noise 0, SGD at lr 1, one step with and without the
attacker's sample, ``B·‖Δrelease‖/R ≤ 1``, or both runs refused before anything is released),
applied to what an analyst's honest mistakes can add around the per-sample norm:

* a clipping function that couples samples (``R / max_j ‖g_j‖``);
* a float64 sample whose squares fall below the normal range, with a normalising clip function;
* a loss that divides by a count over the whole batch (the usual language-model token mean);
* a batch-wide maximum behind a ``clamp`` that honest data leave inactive (the attacker's sample
  activates it);
* a coupling switched on by a flag after the first steps ("mixup after warm-up");
* a frozen parameter used as running statistics and updated in the forward, and a buffer updated
  by a tensor hook during the backward.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from test_privacy_under_attack import (
    DOOR_IDS,
    DOORS,
    MODES,
    B,
    CapturingSGD,
    Case,
    R,
    assert_bounded,
    assert_large,
    honest_vectors,
    large_vector_case,
    mlp,
    opacus_objective,
    opacus_private,
    run_pair,
)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore")]


# -- clipping functions ------------------------------------------------------------------------
def coupled_clip(norms, max_grad_norm):
    """Every factor from the batch's largest norm: one large sample shrinks all the others."""
    return max_grad_norm / norms.max().clamp(min=max_grad_norm) * torch.ones_like(norms)


@pytest.mark.parametrize("mode", MODES)
def test_a_clipping_function_that_couples_samples_is_applied_per_sample(mode):
    """``R / max_j ‖g_j‖`` passes the per-factor check (every ``C_i‖g_i‖ ≤ R``) yet lets the
    attacker scale every honest sample: it is evaluated on each sample's norm alone."""
    case = large_vector_case()
    assert_large(case)
    assert_bounded(*run_pair(case, "native", mode, clip=coupled_clip), what=f"coupled {mode}")


def normalising_clip(norms, max_grad_norm):
    """``R / max(‖g_i‖, tiny)``: trusts the norm down to 1e-300."""
    return max_grad_norm / norms.clamp(min=1e-300)


def mse64(y, t):
    return ((y - t) ** 2).flatten(1).sum(1)


def subnormal_case(scale: float = 1e-81) -> Case:
    """A bias-free float64 MLP; the crafted sample's input and output gradient are ~1e-81, so
    every per-sample gradient entry is ~1e-163, whose square (~1e-326) is below float64's
    smallest subnormal: a norm summed from squares comes out 0 while the entries themselves (and
    a release of them scaled by ``R / norm``) are ordinary numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False)).double()
    g = torch.Generator().manual_seed(3)
    xh = torch.randn(3, 8, generator=g, dtype=torch.float64)
    with torch.no_grad():
        th = model(xh) + 0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    x = torch.randn(1, 8, generator=g, dtype=torch.float64) * scale
    with torch.no_grad():
        t = model(x) - scale * torch.randn(1, 4, generator=g, dtype=torch.float64)
    return Case(model, (xh, th), (x, t), loss=mse64)


@pytest.mark.parametrize("mode", MODES)
def test_float64_sample_below_the_normal_range(mode):
    case = subnormal_case()
    ratio = assert_bounded(*run_pair(case, "native", mode, clip=normalising_clip),
                           what=f"subnormal {mode}")
    assert ratio is not None


# -- couplings the batch flow follows -----------------------------------------------------------
class TokenModel(nn.Module):
    """``Embedding(V, 16) → Linear(16, V)``: next-token logits ``(B, T, V)``."""

    def __init__(self, V: int = 12):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V)

    def forward(self, ids):
        return self.head(self.emb(ids))


def token_case(batch_mean: bool) -> Case:
    """Honest sequences of 2 tokens; the attacker's of 8 (its padding positions carry -100).
    ``batch_mean``: the per-sample loss divides each sample's token sum by the number of tokens
    of the whole batch (``mask.sum()``) — the attacker's long sequence shrinks every honest
    sample's gradient — else by its own (``mask.sum(1)``)."""
    torch.manual_seed(0)
    model = TokenModel()
    g = torch.Generator().manual_seed(1)
    ids_h = torch.randint(0, 12, (3, 8), generator=g)
    lab_h = torch.randint(0, 12, (3, 8), generator=g)
    lab_h[:, 2:] = -100
    ids_a = torch.randint(0, 12, (1, 8), generator=g)
    lab_a = torch.randint(0, 12, (1, 8), generator=g)

    def loss(logits, labels):
        tok = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none",
                              ignore_index=-100)
        mask = labels != -100
        den = mask.sum() if batch_mean else mask.sum(1).clamp(min=1)
        return (tok * mask).sum(1) / den

    return Case(model, (ids_h, lab_h), (ids_a, lab_a), loss=loss)


@pytest.mark.parametrize("mode", MODES)
def test_a_token_mean_over_the_batch_is_refused(mode):
    """Dividing by the batch's token count (it carries no gradient, so no gradient probe sees it)
    is refused at the step, with and without the attacker alike; the per-sample token mean
    trains within R."""
    pair = run_pair(token_case(batch_mean=True), "native", mode)
    assert_bounded(*pair, may_refuse=True, refuse_at="step", what=f"batch token mean {mode}")
    assert "mask.sum(1)" in str(pair[0].error)
    assert_bounded(*run_pair(token_case(batch_mean=False), "native", mode),
                   what=f"per-sample token mean {mode}")


class DormantClamp(nn.Module):
    """``h · clamp(10 / max|h|, max=1)`` with the maximum over the whole batch: inactive while
    every activation is below 10 (honest data), so it carries no gradient; a sample with a large
    activation scales every other sample's output."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.clamp(10 / h.abs().amax(), max=1))


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_a_dormant_batch_coupling_is_refused(door, how):
    torch.manual_seed(0)
    model = DormantClamp()
    xh, th = honest_vectors(model)
    x = torch.full((1, 8), 50.0)
    case = Case(model, (xh, th), (x, torch.zeros(1, 4)))
    pair = run_pair(case, door, how)
    assert_bounded(*pair, may_refuse=True, refuse_at="step", what=f"dormant {door}-{how}")
    assert "amax" in str(pair[0].error)


class LateMixup(nn.Module):
    """A flag the training loop sets after warm-up mixes every sample with its neighbour."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.mix = False

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.mix:
            h = 0.5 * h + 0.5 * h.roll(1, 0)
        return self.fc2(h)


@pytest.mark.parametrize("mode", MODES)
def test_a_coupling_that_starts_later_is_refused_when_it_starts(mode):
    torch.manual_seed(0)
    model = LateMixup()
    x, t = honest_vectors(model, n=4)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    for _ in range(2):
        opt.step(loss=F.mse_loss(model(x), t, reduction="none").sum(1))
    model.mix = True
    with pytest.raises(ValueError, match="roll"):
        opt.step(loss=F.mse_loss(model(x), t, reduction="none").sum(1))
    assert opt.steps == 2 and engine.steps_taken == 2


def test_a_coupling_that_starts_later_is_refused_in_the_opacus_door():
    torch.manual_seed(0)
    model = LateMixup()
    x, t = honest_vectors(model, n=4)
    opt = CapturingSGD(model.parameters())
    engine = pe.opacus_compat.PrivacyEngine(accountant="rdp")
    out = opacus_private(engine, model, opt, "hooks")
    for _ in range(2):
        opacus_objective(out, "hooks", out[0](x), t).backward()
        out[1].step()
        out[1].zero_grad()
    model.mix = True
    with pytest.raises(ValueError, match="roll"):
        opacus_objective(out, "hooks", out[0](x), t).backward()
        out[1].step()
    assert opt.steps == 2


# -- state the step changes ---------------------------------------------------------------------
class FrozenStatistic(nn.Module):
    """A frozen ``nn.Parameter`` used as a running mean of the inputs, updated in the forward
    after it was used (as BatchNorm updates its running statistics): this step's loss does not
    depend on the update, the next step's does, and the state_dict releases it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.center = nn.Parameter(torch.zeros(8), requires_grad=False)

    def forward(self, x):
        out = self.fc(x - self.center)
        if self.training:
            with torch.no_grad():
                self.center.mul_(0.9).add_(0.1 * x.mean(0))
        return out


class BackwardStatistic(nn.Module):
    """A buffer holding an EMA of the hidden gradients' second moment, written by a tensor hook
    during the backward (the forward never touches it)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("grad_ema", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if h.requires_grad:
            h.register_hook(self._track)
        return self.fc2(h)

    def _track(self, grad):
        with torch.no_grad():
            self.grad_ema.mul_(0.9).add_(0.1 * grad.pow(2).mean(0))


@pytest.mark.parametrize("model_cls", [FrozenStatistic, BackwardStatistic])
@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_state_written_by_the_step_is_refused(model_cls, door, how):
    torch.manual_seed(0)
    model = model_cls()
    case = Case(model, honest_vectors(model), (torch.full((1, 8), 30.0), torch.zeros(1, 4)))
    pair = run_pair(case, door, how)
    assert_bounded(*pair, may_refuse=True, refuse_at="step", what=f"{model_cls.__name__}")
    name = "center" if model_cls is FrozenStatistic else "grad_ema"
    assert name in str(pair[0].error)


def test_state_guard_passes_a_model_that_writes_nothing():
    """No false alarm: a plain MLP trains several steps, state untouched but by the optimizer."""
    model = mlp()
    x, t = honest_vectors(model, n=4)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    before = copy.deepcopy(model.state_dict())
    for _ in range(3):
        opt.step(loss=F.mse_loss(model(x), t, reduction="none").sum(1))
    assert engine.steps_taken == 3
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- the model's own randomness ----------------------------------------------------------------
def tiny_gpt2():
    """A GPT-2 with its default dropout (0.1 on embeddings, attention and residuals)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


def gpt2_logits(model, ids):
    B, T = ids.shape
    return model(input_ids=ids, position_ids=torch.arange(T).expand(B, T)).logits


def test_dropout_masks_are_secret_under_a_public_seed():
    """A script seeds torch publicly; without the engine GPT-2's dropout masks follow from the
    seed, with it they do not (two runs from the same seed differ), and the script's own draws
    after the step continue as if the step had drawn nothing."""
    ids = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(1))

    def run(engine: bool):
        model = tiny_gpt2()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if engine:
            pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                             noise_multiplier=1.0).attach(opt)
        torch.manual_seed(7)
        out = gpt2_logits(model, ids)
        if engine:
            opt.step(loss=F.cross_entropy(out.transpose(1, 2), ids, reduction="none").mean(1))
        return out.detach(), torch.rand(4)

    plain_a, _ = run(False)
    plain_b, _ = run(False)
    assert torch.equal(plain_a, plain_b)  # the public seed fixes the masks
    secret_a, after_a = run(True)
    secret_b, after_b = run(True)
    assert not torch.equal(secret_a, secret_b) and not torch.equal(secret_a, plain_a)
    torch.manual_seed(7)
    assert torch.equal(after_a, torch.rand(4)) and torch.equal(after_a, after_b)


def test_dropout_masks_follow_a_given_noise_generator():
    """A reproducible run (a noise_generator given, with its warning) keys the model's randomness
    from it too: two runs agree; the masks still do not come from torch's global seed."""
    ids = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(1))
    outs = []
    for seed in (5, 5, 6):
        model = tiny_gpt2()
        pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                         noise_multiplier=1.0, noise_generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(int(torch.randint(0, 1000, (1,))))
        outs.append(gpt2_logits(model, ids))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_dropout_in_eval_mode_and_outside_the_engine_is_untouched():
    """Evaluation forwards draw nothing, and a model without the engine keeps torch's draws."""
    model = tiny_gpt2()
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=1.0)
    ids = torch.randint(0, 30, (4, 6))
    model.eval()
    with torch.no_grad():
        a, b = gpt2_logits(model, ids), gpt2_logits(model, ids)
    assert torch.equal(a, b)
    engine.detach()
    model.train()
    torch.manual_seed(3)
    c = gpt2_logits(model, ids)
    torch.manual_seed(3)
    assert torch.equal(c, gpt2_logits(model, ids))


# -- the language-model loss in the Opacus door --------------------------------------------------
@pytest.mark.parametrize("flow", ["hooks", "ghost"])
def test_a_token_mean_in_the_opacus_door(flow):
    """Hooks: the mean over the batch's non-ignored tokens is refused when the backward starts,
    for both batches. Ghost: the criterion forms each sample's own token mean: within R."""
    from private_engine import opacus_compat
    from test_privacy_under_attack import refused, released

    def run(ids, labels):
        model = copy.deepcopy(token_case(False).model)
        opt = CapturingSGD(model.parameters())
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.zeros(10 * B, 1)), batch_size=B)
        criterion = nn.CrossEntropyLoss(ignore_index=-100)
        module, optimizer, crit = opacus_compat.PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
            max_grad_norm=R, poisson_sampling=False, grad_sample_mode=flow,
            criterion=criterion)[:3]
        try:
            logits = module(ids)
            n, T, V = logits.shape
            if flow == "hooks":
                loss = criterion(logits.reshape(n * T, V), labels.reshape(-1))
            else:
                loss = crit(logits.reshape(n * T, V), labels.reshape(-1), shape=(n, T))
            loss.backward()
            optimizer.step()
        except ValueError as e:
            return refused(e, "step", opt)
        return released(model, opt)

    case = token_case(False)
    pair = (run(*case.with_sample), run(*case.honest))
    if flow == "hooks":
        assert_bounded(*pair, may_refuse=True, refuse_at="step", what="door token mean hooks")
        assert "nll_loss" in str(pair[0].error)
    else:
        assert_bounded(*pair, what="door token mean ghost")


# -- code the batch flow cannot see ----------------------------------------------------------------
class UnseenDormantClamp(DormantClamp):
    """:class:`DormantClamp` computed with the dispatch modes switched off, as a compiled graph's
    kernels run: the batch flow sees none of its ops."""

    def forward(self, x):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return super().forward(x)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_a_forward_out_of_the_batch_flow_s_sight_is_refused(door, how):
    # the output is differentiable yet no op of the step made it: whether it mixes samples cannot
    # be told, so both runs are refused (the dormant clamp would otherwise pass unseen)
    torch.manual_seed(0)
    model = UnseenDormantClamp()
    xh, th = honest_vectors(model)
    case = Case(model, (xh, th), (torch.full((1, 8), 50.0), torch.zeros(1, 4)))
    pair = run_pair(case, door, how)
    assert_bounded(*pair, may_refuse=True, refuse_at="step", what=f"unseen {door}-{how}")
    assert "could not follow" in str(pair[0].error)


def test_a_compiled_model_is_followed_op_by_op():
    # the training forward of a torch.compile'd model runs eagerly under the batch flow: the
    # dormant coupling of honest data (the clamp inactive, no gradient through it) is seen and
    # refused, naming the op
    torch.manual_seed(0)
    model = DormantClamp()
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    compiled = torch.compile(model, backend="eager")
    x = 0.1 * torch.randn(B, 8)
    with pytest.raises(ValueError, match="mixes samples.*aten.amax reduces over the batch"):
        opt.step(loss=F.mse_loss(compiled(x), torch.zeros(B, 4), reduction="none").sum(1))
    assert opt.steps == 0 and engine.steps_taken == 0
