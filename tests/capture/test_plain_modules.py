"""Submodules the parameter-entry tracer need not follow run without its mode
(private_engine/plain_modules.py).

Each skipped forward must give exactly the clipped sums of a traced one (float64 reference), and a
skipped forward that differs from its verification must fail loudly, never clip silently wrong.
"""
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from engine_checks import check_against_reference, make_engine
from private_engine.capture.plain_modules import TRACED, plain_candidates
from private_engine.capture.tracer import ParamTracer

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=16,
                             depth=2, num_heads=2, num_classes=3)


def ce(m, x, y):
    return F.cross_entropy(m(x), y, reduction="none")


class CountOps(torch.overrides.TorchFunctionMode):
    """Counts the ops that reach a module's forward through the torch-function mode stack (none
    while it is empty)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_vit_blocks_run_without_the_mode_once_verified_and_give_the_reference_sums():
    model = tiny_vit().double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0])
    # verify, then skip
    engine = check_against_reference(model, [x, y], ce, mode="bk_mixed", clip="abadi", rtol=1e-9)
    assert engine.clipper.tracer is not None

    engine = make_engine(model, 4, mode="bk_mixed")
    tracer = engine.clipper.tracer
    names = {id(m): n for n, m in model.named_modules()}
    assert sorted(names[id(m)] for m in tracer.plain.modules) == ["blocks", "patch_embed"]
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, a: seen.append(torch.overrides._get_current_function_mode() is tracer))
    first, _ = engine.clipped_grad_sum(ce(model, x, y))
    second, _ = engine.clipped_grad_sum(ce(model, x, y))
    # traced to verify, then the mode is off the stack inside the blocks
    assert seen == [True, False]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    # one verdict per input signature; the first forward, probed for separability, gave patch_embed
    # a differentiable input, so it has a second signature with the same verdict
    verdicts = {names[k]: set(v.values()) for k, v in tracer.plain.verdicts.items()}
    assert verdicts == {"blocks": {(0,)}, "patch_embed": {(0,)}}
    assert len(tracer.plain.verdicts[id(model.patch_embed)]) <= 2


def test_switching_skipping_off_traces_every_op(monkeypatch):
    monkeypatch.setattr(ParamTracer, "skip_plain_modules", False)
    model = tiny_vit()
    engine = make_engine(model, 2, mode="bk_mixed")
    tracer = engine.clipper.tracer
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, a: seen.append(torch.overrides._get_current_function_mode() is tracer))
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([0, 1])
    for _ in range(2):
        engine.clipped_grad_sum(ce(model, x, y))
    assert seen == [True, True] and not tracer.plain.verdicts


def test_a_new_signature_is_verified_again():
    torch.manual_seed(0)
    model = TokenModel()  # sequence lengths change from batch to batch
    engine = make_engine(model, 3, mode="bk_mixed")
    tracer = engine.clipper.tracer
    for T in (5, 5, 7, 7):
        engine.clipped_grad_sum(model(torch.randn(3, T, 4)).pow(2).sum((1, 2)))
    (verdicts,) = tracer.plain.verdicts.values()
    assert ([key[0][0] for key in verdicts] == [(3, 5, 4), (3, 7, 4)]
            and all(v == (0,) for v in verdicts.values()))


class TokenModel(nn.Module):
    def __init__(self, rows_per_sample: int = 1, late_token: bool = False):
        super().__init__()
        self.token = nn.Parameter(torch.randn(4))
        self.body = Body(self, rows_per_sample)
        self.late_token = late_token

    def forward(self, x):
        return self.body(x + self.token)


class Body(nn.Module):
    """A submodule owning no tracked parameter: a plain candidate."""

    def __init__(self, owner, rows_per_sample: int):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.rows = rows_per_sample
        self._owner = [owner]  # not a submodule: the token is the owner's parameter

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.rows > 1:  # k·B rows, sample-major: the tracer must vouch for them
            h = h.reshape(h.shape[0] * self.rows, -1, h.shape[-1])
        h = self.fc2(h).reshape(x.shape)
        owner = self._owner[0]
        # a tracked parameter used inside, on some batches only (data-dependent control flow)
        if owner.late_token:
            h = h * owner.token
        return h


def sum_loss(out):
    return out.pow(2).sum(tuple(range(1, out.dim())))


def test_k_rows_per_sample_inside_keep_the_module_traced():
    torch.manual_seed(0)
    model = TokenModel(rows_per_sample=2).double()
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = check_against_reference(model, [x], lambda m, x: sum_loss(m(x)), mode="bk_mixed",
                                         clip="abadi", rtol=1e-9)
    (verdicts,) = engine.clipper.tracer.plain.verdicts.values()
    assert list(verdicts.values()) == [TRACED]


def test_a_tracked_parameter_used_inside_a_skipped_module_fails_loudly():
    torch.manual_seed(0)
    model = TokenModel()
    engine = make_engine(model, 3, mode="bk_mixed")
    x = torch.randn(3, 2, 4)
    engine.clipped_grad_sum(sum_loss(model(x)))  # verified plain: the token is not used inside
    model.late_token = True
    # skipped: the graph walk finds the token unclipped
    with pytest.raises(ValueError, match=r"\['token'\]"):
        engine.clipped_grad_sum(sum_loss(model(x)))


def test_a_tracked_parameter_used_inside_is_traced_when_it_is_used_at_verification():
    torch.manual_seed(0)
    model = TokenModel(late_token=True).double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    engine = check_against_reference(model, [x], lambda m, x: sum_loss(m(x)), mode="bk_mixed",
                                     clip="abadi", rtol=1e-9)
    (verdicts,) = engine.clipper.tracer.plain.verdicts.values()
    assert list(verdicts.values()) == [TRACED]


class Boom(Exception):
    pass


def test_the_mode_comes_back_after_an_error_inside_a_skipped_module():
    torch.manual_seed(0)
    model = TokenModel()
    engine = make_engine(model, 3, mode="bk_mixed")
    tracer = engine.clipper.tracer
    x = torch.randn(3, 2, 4)
    engine.clipped_grad_sum(sum_loss(model(x)))
    handle = model.body.fc2.register_forward_hook(lambda *a: (_ for _ in ()).throw(Boom()))
    depth = torch.overrides._len_torch_function_stack()
    with pytest.raises(Boom):
        model(x)
    assert (torch.overrides._len_torch_function_stack() == depth and not tracer.active
            and not tracer.skipping)
    handle.remove()
    engine.clipper.release()
    # traced again after the error: the verdict stands, so the late use is still caught
    model.late_token = True
    with pytest.raises(ValueError, match=r"\['token'\]"):
        engine.clipped_grad_sum(sum_loss(model(x)))


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x):  # (B, T, 4) -> (T, B, 4)
        return self.act(self.fc(x)).transpose(0, 1)


class MovedThenEntry(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Transposed()
        self.gain = nn.Parameter(torch.randn(1, 1, 4))

    def forward(self, x):
        return (self.body(x) * self.gain).transpose(0, 1)


def test_outputs_of_a_skipped_module_keep_the_verified_batch_dimension():
    torch.manual_seed(0)
    model = MovedThenEntry()
    engine = make_engine(model, 3, mode="bk_mixed")
    # T == B: only the batch dimension the tracer followed tells rows from samples
    x = torch.randn(3, 3, 4)
    # traced (verification), then skipped: the same refusal every time. The first forward's
    # input is the separability probe's differentiable copy (requires_grad: a key of its own)
    for _ in range(3):
        with pytest.raises(ValueError, match="moved from dim 0"):
            engine.clipped_grad_sum(sum_loss(model(x)))
        engine.clipper.release()
    (verdicts,) = engine.clipper.tracer.plain.verdicts.values()
    assert list(verdicts.values()) == [(1,), (1,)]


def test_candidates_are_maximal_and_avoid_tracked_parameters_and_opaque_modules():
    model = tiny_vit()
    tracked = {id(model.cls_token), id(model.pos_embed)}
    names = {id(m): n for n, m in model.named_modules()}
    assert sorted(names[id(m)] for m in plain_candidates(model, tracked, [])) == [
        "blocks", "patch_embed"]
    got = sorted(names[id(m)] for m in plain_candidates(model, tracked, [model.blocks[1].attn]))
    # leaves (norms, Identity) are never candidates
    assert got == ["blocks.0", "blocks.1.mlp", "patch_embed"]
    tracked.add(id(model.blocks[0].mlp.fc1.weight))
    got = sorted(names[id(m)] for m in plain_candidates(model, tracked, []))
    assert got == ["blocks.0.attn", "blocks.1", "patch_embed"]


class FixedGridEncoding(nn.Module):
    """A Linear on a constant grid (XCiT's Fourier encoding): the tracer takes the call over and
    follows its parameters to where the encoding meets the batch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("grid", torch.linspace(-1, 1, 12).reshape(1, 3, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(self.grid)


class GridModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = FixedGridEncoding()
        self.token = nn.Parameter(torch.randn(4))
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x):  # (B, 3, 4)
        return self.body(x + self.token + self.pos(x))


def test_a_layer_taken_over_by_the_tracer_keeps_its_module_traced():
    torch.manual_seed(0)
    model = GridModel().double()
    x = torch.randn(3, 3, 4, dtype=torch.float64)
    engine = check_against_reference(model, [x], lambda m, x: sum_loss(m(x)), mode="bk_mixed",
                                     clip="abadi", rtol=1e-9)
    plain = engine.clipper.tracer.plain
    verdicts = {n: set(plain.verdicts[id(m)].values()) for n, m in model.named_modules()
                if id(m) in plain.verdicts}  # one per input signature (see above)
    assert verdicts == {"pos": {TRACED}, "body": {(0,)}}


def test_outputs_with_scalar_tuples_are_marked():
    from private_engine.capture.plain_modules import _output_tensors

    t = torch.zeros(2)
    assert _output_tensors((t, (3, 4))) == [t]
    assert _output_tensors((t, [t])) is None and _output_tensors({"x": t}) is None
