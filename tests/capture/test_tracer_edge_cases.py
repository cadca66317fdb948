"""Regression tests for edge cases of the parameter-entry tracer and the torch.func fallback.

Each case once gave silently wrong per-sample norms (or crashed); it must now either match the
float64 one-sample-at-a-time reference (tests/reference.py) or raise an error naming the problem.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import check_against_reference, make_engine
from private_engine.capture.tracer import UnsupportedEntryError

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-6


def sq_loss(m, x):
    return m(x).pow(2).sum(1)


def check(model, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_against_reference(model.double(), [x], sq_loss, mode="mixed", clip="abadi",
                                       rtol=RTOL)


# -- 1. rows concatenated / repeated along dim 0 are not grouped by sample -------------------------
class CatRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3))
        self.fc = nn.Linear(3, 2)

    def forward(self, x):  # (B, 3)
        h = x * self.p
        z = self.fc(torch.cat([h, torch.tanh(h)], 0))  # (2B, 2): rows r and r+B belong to sample r
        B = x.shape[0]
        return z[:B] + z[B:]


class RepeatRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3))
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = (x * self.p).repeat(2, 1)
        z = self.fc(torch.tanh(h * torch.arange(1, 2 * x.shape[0] + 1, dtype=x.dtype)[:, None]))
        B = x.shape[0]
        return z[:B] + z[B:]


@pytest.mark.parametrize("cls", [CatRows, RepeatRows])
def test_rows_stacked_along_dim0_are_refused(cls):
    torch.manual_seed(0)
    # the separability probe (layer fc), or the batch flow (position weights)
    with pytest.raises(ValueError, match="mixes samples.*(layer fc|position)"):
        check(cls(), torch.randn(4, 3, dtype=torch.float64))


# -- 2. a sequence-first layout whose length equals the batch size ---------------------------------
class SeqFirstEntry(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):  # (B, T, 3) with T == B
        h = x.transpose(0, 1) * self.p  # an entry on a (T, B, 3) operand: batch in dim 1
        return self.fc(h.transpose(0, 1)).flatten(1)


class SeqFirstLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):  # (B, T, 3) with T == B
        h = self.fc(x.transpose(0, 1))  # the Linear sees T rows, the batch is in dim 1
        return (h.transpose(0, 1) * self.p).flatten(1)


def test_seq_first_entry_with_length_equal_to_batch_is_refused():
    torch.manual_seed(0)
    with pytest.raises(UnsupportedEntryError, match="batch dimension was moved"):
        check(SeqFirstEntry(), torch.randn(4, 4, 3, dtype=torch.float64))


def test_seq_first_layer_with_length_equal_to_batch_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="batch-first"):
        check(SeqFirstLinear(), torch.randn(4, 4, 3, dtype=torch.float64))


class PooledGamma(nn.Module):
    """A reduction over tokens keeps the batch in dim 0: the entry after it is still clipped
    exactly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.randn(3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):  # (B, T, 3)
        h = self.fc(x)
        return self.head(h.mean(1) * self.gamma + h.amax(dim=1) * self.gamma.sigmoid())


def test_entry_after_token_reduction_matches_reference():
    torch.manual_seed(0)
    check(PooledGamma(), torch.randn(4, 5, 3, dtype=torch.float64))


# -- 3. a per-sample tensor computed under no_grad and passed to a fallback module -----------------
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x, g):
        return torch.tanh(x @ self.w) * g


pe.layers.register_fallback(Gate)


class NoGradGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.gate = Gate()

    def forward(self, x):  # (B, 3)
        with torch.no_grad():
            g = torch.sigmoid(x).mean(1, keepdim=True)  # (B, 1): per sample, computed without grad
        return self.gate(self.fc(x), g)


def test_no_grad_batched_tensor_into_fallback_matches_reference():
    torch.manual_seed(0)
    check(NoGradGate(), torch.randn(4, 3, dtype=torch.float64))


# -- 4. F.linear on a batch-expanded token with another Linear's bias ------------------------------
class ForeignBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 3)
        self.latent = nn.Parameter(torch.randn(1, 2, 3))
        self.fc = nn.Linear(3, 3)
        self.fc2 = nn.Linear(3, 3)

    def forward(self, x):  # (B, 2, 3)
        B = x.shape[0]
        # fc2.bias, not fc.bias
        q = F.linear(self.latent.expand(B, -1, -1), self.fc.weight, self.fc2.bias)
        return (self.fc2(self.inp(x)) * q).flatten(1)


def test_linear_entry_with_foreign_bias_is_refused():
    torch.manual_seed(0)
    with pytest.raises(UnsupportedEntryError, match="fc2.bias|bias"):
        check(ForeignBias(), torch.randn(4, 2, 3, dtype=torch.float64))


class OwnBias(ForeignBias):
    def forward(self, x):
        B = x.shape[0]
        q = F.linear(self.latent.expand(B, -1, -1), self.fc.weight, self.fc.bias)
        return (self.fc2(self.inp(x)) * q).flatten(1)


def test_linear_entry_with_own_bias_matches_reference():
    torch.manual_seed(0)
    check(OwnBias(), torch.randn(4, 2, 3, dtype=torch.float64))


# -- 5. a Linear handed over to the tracer, then a batch of one (Poisson sampling) -----------------
class GridPos(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("grid", torch.randn(1, 4, 3))
        self.pos = nn.Linear(3, 3)
        self.fc = nn.Linear(3, 1)
        self.g = nn.Parameter(torch.randn(3))

    def forward(self, x):  # (B, 4, 3)
        return self.fc((x + self.pos(self.grid)) * self.g).flatten(1)


def test_handover_survives_batch_size_change():
    from reference import assert_close_rel

    torch.manual_seed(0)
    m = GridPos().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = make_engine(m, 3, R=1e6)
    params = list(m.parameters())
    for B in (3, 1, 2):
        x = torch.randn(B, 4, 3, dtype=torch.float64)
        grads, n = eng.clipped_grad_sum(sq_loss(m, x))
        assert n == B
        ref = [torch.autograd.grad(sq_loss(m, x[i:i + 1]).sum(), params) for i in range(B)]
        ref_norms = torch.stack([sum(g.pow(2).sum() for g in r) for r in ref]).sqrt()
        assert_close_rel([eng.last_norms], [ref_norms], RTOL, [f"norms B={B}"])
        assert_close_rel(grads, [sum(r[k] for r in ref) for k in range(len(params))], RTOL)


class TransposedLinear(nn.Module):
    """``x.T`` moves the batch to dim 1: a Linear on it sees features as rows (B == features
    here)."""

    def __init__(self, attr="T"):
        super().__init__()
        self.attr = attr
        self.p = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # (B, 4) with B == 4
        h = x * self.p
        return getattr(self.fc(getattr(h, self.attr)), self.attr)


@pytest.mark.parametrize("attr", ["T", "mT"])
def test_transposed_batch_into_a_layer_is_refused(attr):
    torch.manual_seed(0)
    m = TransposedLinear(attr).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = make_engine(m, 4)
    # (no per-sample reference: the model mixes samples); the batch flow sees the Linear contract
    # the batch dimension before the clipper sees its rows
    with pytest.raises(ValueError, match="batch-first|contracts the batch dimension|sum over the "
                                         "batch"):
        eng.clipped_grad_sum(sq_loss(m, torch.randn(4, 4, dtype=torch.float64)))


class NumpyGate(NoGradGate):
    def forward(self, x):  # a per-sample tensor the tracer cannot see computed from the inputs
        g = torch.from_numpy(x.detach().numpy().mean(1, keepdims=True))
        return self.gate(self.fc(x), g)


def test_unmarked_batch_sized_tensor_into_fallback_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="did not see computed from the model's inputs"):
        check(NumpyGate(), torch.randn(4, 3, dtype=torch.float64))


class TinyLM(nn.Module):
    """Token embedding + a raw positional parameter (an entry after F.embedding, which adds a dim) +
    a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.pos = nn.Parameter(torch.randn(1, 5, 4))
        self.gamma = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):  # (B, 5)
        h = self.fc(self.emb(ids) + self.pos)
        h = h + self.gamma * torch.stack([h[:, 0], h[:, -1]], 1).mean(1, keepdim=True)
        return self.head(h[..., 1:, :].mean((1,)) * self.gamma).flatten(1)


def test_entries_after_embedding_stack_and_indexing_match_reference():
    torch.manual_seed(0)
    check(TinyLM(), torch.randint(0, 7, (4, 5)))


def test_tensor_map_identity_and_weak_keys():
    """The tracer's tensor map: keys by identity (equal values are different keys), never keeps a
    tensor alive, forgets a freed tensor, and never mistakes a new tensor that reuses a freed one's
    id for it."""
    import gc
    import weakref

    from private_engine.capture.tensor_map import TensorMap

    m = TensorMap()
    a, b = torch.zeros(3), torch.zeros(3)
    m[a] = 0
    assert a in m and b not in m and m[a] == 0 and m.get(b, -1) == -1 and m.get(a) == 0
    with pytest.raises(KeyError):
        m[b]
    m[a] = 2  # overwrite
    assert m[a] == 2 and len(m) == 1
    alive = weakref.ref(a)
    del a
    gc.collect()
    assert alive() is None and len(m) == 0 and not m._entries  # dropped, and not kept alive
    # an entry whose tensor is another one under the same id (id reuse) is not a hit
    c = torch.ones(2)
    m._entries[id(c)] = (weakref.ref(b), 7)
    assert c not in m and m.get(c) is None
