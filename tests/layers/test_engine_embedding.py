"""nn.Embedding with and without padding_idx, repeated tokens, ids of rank 1–3."""
import pytest
import torch
from torch import nn

from engine_checks import CLIPS, MODES, check_against_reference, gen_for, rng_for, target_like

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = range(3)


def embedding_case(id_rank: int, seed: int, padding: bool):
    rng = rng_for("embedding", id_rank, seed, padding)
    B = rng.randint(3, 6)
    V, dim = rng.randint(3, 7), rng.randint(1, 5)
    shape = {1: (), 2: (rng.randint(4, 9),), 3: (rng.randint(2, 3), rng.randint(2, 4))}[id_rank]
    padding_idx = rng.choice([rng.randrange(V), -1]) if padding else None
    torch.manual_seed(seed)
    emb = nn.Embedding(V, dim, padding_idx=padding_idx)
    gen = gen_for(seed)
    ids = torch.randint(0, V, (B, *shape), generator=gen)  # V small: tokens repeat within a sample
    if padding and ids[0].numel() > 1:
        ids.view(B, -1)[:, 0] = emb.padding_idx  # every sample has a padding token...
        ids.view(B, -1)[0, :] = emb.padding_idx  # ...and one sample is all padding
    if seed % 2:  # a trainable layer after it
        model = nn.Sequential(emb, nn.Tanh(), nn.Linear(dim, rng.randint(1, 4)))
    else:
        model = nn.Sequential(emb)
    model = model.double()
    return model, [ids, target_like(model, ids, gen)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding", [False, True], ids=["no_pad", "padding_idx"])
@pytest.mark.parametrize("id_rank", [1, 2, 3])
def test_embedding_matches_reference(id_rank, padding, mode, clip, seed):
    model, inputs = embedding_case(id_rank, seed, padding)
    check_against_reference(model, inputs, mode=mode, clip=clip)


def test_embedding_repeated_tokens_ghost_norm():
    """All tokens equal in a sample: the per-sample gradient row is Σ_t g_t (cross terms count)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4, 3)).double()
    ids = torch.tensor([[2, 2, 2, 2], [0, 1, 2, 3], [1, 1, 3, 3]])
    gen = gen_for(0)
    for mode in MODES:
        check_against_reference(model, [ids, target_like(model, ids, gen)], mode=mode, clip="abadi")


def test_embedding_padding_row_gets_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3, padding_idx=0)).double()
    ids = torch.tensor([[0, 0, 1], [0, 2, 2], [3, 4, 0]])
    gen = gen_for(1)
    t = target_like(model, ids, gen)
    for mode in MODES:
        check_against_reference(model, [ids, t], mode=mode, clip="automatic")
    from engine_checks import make_engine, quadratic_loss
    engine = make_engine(model, 3, R=1.0)
    (grad,), _ = engine.clipped_grad_sum(quadratic_loss(model, ids, t))
    assert torch.equal(grad[0], torch.zeros(3, dtype=torch.float64))
