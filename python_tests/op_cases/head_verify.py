"""Cases of contrastive_topk and verify_tree shared by their CPU tests (ops/) and GPU tests (gpu/)."""
import torch

from conftest import gen, randn, random_parents

def contrast_weights(lead, seed):
    return torch.softmax(randn(*lead, 2, seed=seed), -1).sort(-1, descending=True).values


# (leading dims, hidden, vocab, k)
CONTRASTIVE_SHAPES = [((1,), 64, 1, 1), ((3, 5), 54, 1000, 10), ((20,), 128, 4099, 7), ((2, 10), 576, 49152, 10), ((4,), 32, 97, 97)]


def plant_acceptable_paths(parents, tokens, logits, seed, p_plant=0.7):
    """Make the target agree with some drafted children: at each node, with probability
    p_plant, the target's argmax becomes the token of one of its children."""
    g = gen(seed)
    B, T = parents.shape
    for b in range(B):
        for node in range(T):
            children = [c for c in range(T) if int(parents[b, c]) == node]
            if children and float(torch.rand(1, generator=g)) < p_plant:
                c = children[int(torch.randint(len(children), (1,), generator=g))]
                logits[b, node, tokens[b, c]] = logits[b, node].max() + 3.0
    return logits


def make_tree(B, T, V, seed, dtype=torch.float32, duplicates=True):
    parents = random_parents(B, T, seed=seed, max_children=6)
    tokens = torch.randint(0, V, (B, T), generator=gen(seed + 1))
    if duplicates:  # siblings proposing the same token (two experts agreeing)
        for b in range(B):
            for c in range(2, T):
                if int(parents[b, c]) == int(parents[b, c - 1]) and c % 3 == 0:
                    tokens[b, c] = tokens[b, c - 1]
    logits = randn(B, T, V, seed=seed + 2, scale=2.0)
    logits = plant_acceptable_paths(parents, tokens, logits, seed + 3).to(dtype)
    uniforms = torch.rand(B, T + 1, generator=gen(seed + 4), dtype=torch.float64)
    return parents, tokens, logits, uniforms


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == torch.int64
        assert torch.equal(g, w), (g, w)


SAMPLING_FILTERS = [(1.0, 1.0, 0), (0.6, 1.0, 0), (1.5, 0.9, 0), (0.8, 0.5, 0), (1.0, 1.0, 5), (0.7, 0.8, 20), (1.0, 0.05, 0)]
