"""verify_tree: greedy and sampling against the reference (exact), and a statistical test that
sampling verification emits exactly the target's filtered distribution."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import gen
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.head_verify import SAMPLING_FILTERS, assert_same, make_tree



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,V", [(1, 1, 5), (3, 60, 97), (2, 26, 1000), (1, 130, 49152)])
@pytest.mark.covers("verify_tree", "adversarial_shapes")
def test_verify_tree_matches_reference_greedy(B, T, V, dtype):
    parents, tokens, logits, _ = make_tree(B, T, V, seed=T + V, dtype=dtype)
    got = ops.verify_tree(parents, tokens, logits)
    assert_same(got, reference.verify_tree(parents, tokens, logits))
    path, accept_len, bonus = got
    for b in range(B):  # the invariant itself: each accepted token is the target's argmax at its parent
        n = int(accept_len[b])
        nodes = path[b, : n + 1].tolist()
        assert nodes[0] == 0 and torch.all(path[b, n + 1 :] == -1)
        for parent, child in zip(nodes, nodes[1:]):
            assert int(parents[b, child]) == parent
            assert int(tokens[b, child]) == int(logits[b, parent].float().argmax())
        assert int(bonus[b]) == int(logits[b, nodes[-1]].float().argmax())
    if T >= 26:
        assert int(accept_len.max()) >= 1  # the planted paths are found



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,top_p,top_k", SAMPLING_FILTERS)
@pytest.mark.parametrize("B,T,V", [(4, 1, 7), (6, 60, 97), (2, 26, 5000)])
def test_verify_tree_matches_reference_sampling(B, T, V, temperature, top_p, top_k, dtype):
    parents, tokens, logits, uniforms = make_tree(B, T, V, seed=3 * T + V, dtype=dtype)
    got = ops.verify_tree(parents, tokens, logits, uniforms, temperature, top_p, top_k)
    assert_same(got, reference.verify_tree(parents, tokens, logits, uniforms, temperature, top_p, top_k))


@pytest.mark.parametrize("top_p", [0.1, 0.9, 0.95, 0.9999999])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_top_p_over_a_whole_vocabulary_keeps_the_references_tokens(top_p, scale):
    """A 49,152-token row (flat, spread or peaked; a third of it in ties): the bonus drawn at u
    near 0 and near 1 is the lowest- and highest-id token the filter keeps (the inverse CDF runs in
    token order), so the kept set's ends are the reference's exactly."""
    g = gen(int(scale * 10) + int(top_p * 100))
    logits = torch.randn(1, 1, 49152, generator=g) * scale
    logits[..., ::3] = (logits[..., ::3] * 2).round() / 2  # ties
    parents, tokens = torch.tensor([[-1]]), torch.tensor([[0]])
    for u in (1e-9, 0.5, 1 - 1e-9):
        uniforms = torch.full((1, 2), u, dtype=torch.float64)
        got = ops.verify_tree(parents, tokens, logits, uniforms, 1.0, top_p, 0)
        assert_same(got, reference.verify_tree(parents, tokens, logits, uniforms, 1.0, top_p, 0))


# --------------------------------------------------------------------------- statistics
# One fixed tree over a 6-token vocabulary, verified for many independent draws at once.
# Root's children propose tokens 2, 2 (a duplicate), 4, 1; node 1 (token 2) has children
# proposing 0 and 3. The target's logits at both token-2 nodes are the same (same context).
PARENTS = [-1, 0, 0, 0, 0, 1, 1]
TOKENS = [5, 2, 2, 4, 1, 0, 3]
ROOT_LOGITS = [0.3, 1.0, 2.0, -0.5, 1.4, 0.1]
TOKEN2_LOGITS = [1.2, -1.0, 0.2, 0.9, 0.0, 0.5]
FILTERS = [(1.0, 1.0, 0), (0.7, 0.85, 0), (1.3, 1.0, 3)]


def tree_batch(draws):
    logits = torch.randn(1, 7, 6, generator=gen(0)).repeat(draws, 1, 1)
    logits[:, 0] = torch.tensor(ROOT_LOGITS)
    logits[:, 1] = torch.tensor(TOKEN2_LOGITS)
    logits[:, 2] = torch.tensor(TOKEN2_LOGITS)
    parents = torch.tensor(PARENTS).repeat(draws, 1)
    tokens = torch.tensor(TOKENS).repeat(draws, 1)
    return parents, tokens, logits


def emitted(path, accept_len, bonus, tokens):
    """First two emitted tokens per draw (second = -1 when the step emitted only one)."""
    n = accept_len.numpy()
    seq = np.full((len(n), 2), -1)
    accepted = tokens.gather(1, path.clamp_min(0)).numpy()
    for i in range(len(n)):
        out = list(accepted[i, 1 : n[i] + 1]) + [int(bonus[i])]
        seq[i, : min(2, len(out))] = out[:2]
    return seq


def chi_square_pvalue(samples, probs):
    support = probs > 0
    counts = np.bincount(samples, minlength=len(probs))
    assert counts[~support].sum() == 0, f"tokens outside the filtered support were emitted: {counts}"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return chisquare(counts[support], expected).pvalue


def lossy_first_tokens(root_probs, uniforms):
    """A known-lossy verifier (no residual: a rejected token keeps its mass, the bonus is drawn from
    the unmodified distribution), to show the test below can fail."""
    children = [2, 2, 4, 1]
    out = []
    cdf = np.cumsum(root_probs)
    for u in uniforms:
        tok = next((x for x, uc in zip(children, u[1:5]) if uc < root_probs[x]), None)
        out.append(tok if tok is not None else int(np.searchsorted(cdf, u[7] * cdf[-1], side="right")))
    return np.array(out)


@pytest.mark.parametrize("temperature,top_p,top_k", FILTERS)
def test_sampling_verification_emits_the_target_distribution(temperature, top_p, top_k):
    draws = 40000
    parents, tokens, logits = tree_batch(draws)
    uniforms = torch.rand(draws, 8, generator=gen(11), dtype=torch.float64)
    path, accept_len, bonus = ops.verify_tree(parents, tokens, logits, uniforms, temperature, top_p, top_k)
    seq = emitted(path, accept_len, bonus, tokens)

    root_p = reference.filtered_distribution(torch.tensor(ROOT_LOGITS), temperature, top_p, top_k).numpy()
    assert chi_square_pvalue(seq[:, 0], root_p) > 1e-3
    # After an accepted token 2, the next token must follow the target at token 2's node.
    token2_p = reference.filtered_distribution(torch.tensor(TOKEN2_LOGITS), temperature, top_p, top_k).numpy()
    after2 = seq[seq[:, 0] == 2, 1]
    assert len(after2) > 1000 and np.all(after2 >= 0)
    assert chi_square_pvalue(after2, token2_p) > 1e-3
    # The same statistic flags a lossy verifier on the same draws: the test has power.
    assert chi_square_pvalue(lossy_first_tokens(root_p, uniforms.numpy()), root_p) < 1e-6


def test_verify_tree_all_mass_on_the_children():
    # Top-k keeps only the two drafted tokens: rejecting the first must accept the second, even
    # when the draw is as close to 1 as float64 allows (rounding must not leave an empty residual).
    parents = torch.tensor([[-1, 0, 0]])
    tokens = torch.tensor([[0, 3, 1]])
    logits = torch.tensor([[[0.0, 1.0, -5.0, 1.2], [0.0] * 4, [0.0] * 4]])
    uniforms = torch.tensor([[0.5, 1.0 - 2**-53, 1.0 - 2**-53, 0.5]], dtype=torch.float64)
    got = ops.verify_tree(parents, tokens, logits, uniforms, temperature=0.7, top_k=2)
    assert_same(got, reference.verify_tree(parents, tokens, logits, uniforms, temperature=0.7, top_k=2))
    assert got[0][0, :2].tolist() == [0, 2] and int(got[1][0]) == 1


def test_verify_tree_opcheck():
    parents, tokens, logits, uniforms = make_tree(2, 12, 50, seed=5)
    torch.library.opcheck(torch.ops.jakiro.verify_tree.default, (parents, tokens, logits, None, 0.0, 1.0, 0))
    torch.library.opcheck(torch.ops.jakiro.verify_tree.default, (parents, tokens, logits, uniforms, 0.8, 0.9, 10))


def test_verify_tree_bad_input_errors():
    parents, tokens, logits, uniforms = make_tree(2, 6, 20, seed=6)
    bad_parents = parents.clone()
    bad_parents[1, 4] = 4
    bad_root = parents.clone()
    bad_root[0, 0] = 0
    bad_tokens = tokens.clone()
    bad_tokens[0, 3] = 20
    cases = [
        ((bad_parents, tokens, logits), {}, r"parents\[1, 4\] must be in \[0, 4\) \(nodes in topological order\), got 4"),
        ((bad_root, tokens, logits), {}, r"parents\[0, 0\] must be -1"),
        ((parents, bad_tokens, logits), {}, r"draft_tokens\[0, 3\] must be a token id in \[0, 20\), got 20"),
        ((parents, tokens[:, :5], logits), {}, r"draft_tokens must have the shape of parents"),
        ((parents, tokens, logits[:, :5]), {}, r"target_logits must have shape \[B, T, V\]"),
        ((parents, tokens, logits), dict(temperature=0.5), r"needs uniforms \[B, T \+ 1\] float64"),
        ((parents, tokens, logits, uniforms.float()), dict(temperature=0.5), r"uniforms must have dtype Double"),
        ((parents, tokens, logits, uniforms[:, :6]), dict(temperature=0.5), r"uniforms must have shape \[B, T \+ 1\] = \[2, 7\]"),
        ((parents, tokens, logits, uniforms), dict(temperature=0.5, top_p=0.0), r"top_p must be in \(0, 1\], got 0"),
        ((parents, tokens, logits, uniforms), dict(temperature=-1.0), r"temperature must be finite and >= 0"),
        ((parents, tokens, logits, uniforms), dict(temperature=1.0, top_k=-2), r"top_k must be >= 0"),
        ((parents.int(), tokens, logits), {}, r"parents must have dtype Long"),
        ((parents, tokens, logits, uniforms + 1.0), dict(temperature=1.0), r"uniforms must be in \[0, 1\), got"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.verify_tree(*args, **kwargs)


ARGMAX_CHECK = """
import math
import torch
from jakiro_ext import ops
inf, nan = math.inf, math.nan


def greedy_token(row):
    '''The CPU op's greedy bonus token of a one-node tree (-1: the row gives no distribution).'''
    try:
        return int(ops.verify_tree(torch.tensor([[-1]]), torch.tensor([[0]]), row.reshape(1, 1, -1))[2][0])
    except RuntimeError as error:
        assert "give no distribution" in str(error), error
        return -1


def expected(row):
    '''Ties: the lowest id; NaN or +inf anywhere, or every value -inf: no distribution.'''
    if torch.isnan(row).any() or (row == inf).any() or (row == -inf).all():
        return -1
    return int(torch.nonzero(row == row.max())[0, 0])


cases = 0
for V in (1, 15, 16, 17, 31, 32, 33, 1000, 49152, 49153):
    g = torch.Generator().manual_seed(V)
    for kind in ("random", "tie_body_tail", "max_in_tail", "zeros_signed", "all_neg_inf", "neg_inf_and_one",
                 "nan_body", "nan_tail", "inf_body", "inf_tail", "ties_everywhere"):
        row = torch.randn(V, generator=g)
        last = V - 1
        if kind == "tie_body_tail":
            row[last] = row[V // 2] = row.max() + 1.0
        elif kind == "max_in_tail":
            row[last] = row.max() + 1.0
        elif kind == "zeros_signed":
            row = torch.full((V,), -1.0)
            row[V // 3] = -0.0
            row[last] = 0.0
        elif kind == "all_neg_inf":
            row = torch.full((V,), -inf)
        elif kind == "neg_inf_and_one":
            row = torch.full((V,), -inf)
            row[last] = -3.0
        elif kind in ("nan_body", "inf_body"):
            row[V // 2] = nan if kind == "nan_body" else inf
        elif kind in ("nan_tail", "inf_tail"):
            row[last] = nan if kind == "nan_tail" else inf
        elif kind == "ties_everywhere":
            row = (row * 2).round()
        got, want = greedy_token(row.contiguous()), expected(row)
        assert got == want, (V, kind, got, want)
        cases += 1
print(cases)
"""


@pytest.mark.parametrize("setting", ["detected", "JAKIRO_CPU_AVX512=0"])
@pytest.mark.covers("verify_tree", "adversarial_shapes")
def test_verify_tree_greedy_argmax_on_adversarial_rows_on_both_cpu_paths(setting, tmp_path):
    """The greedy scan (512-bit vectors where the CPU has them, else scalar): ties to the lowest
    id in the vectors and in the tail, +0 / -0, NaN or +inf in either part, all -inf, lengths
    around the vector width and the default model's vocabulary."""
    from test_linear import run_kernel_check

    out = run_kernel_check(ARGMAX_CHECK, tmp_path, **({} if setting == "detected" else dict([setting.split("=")])))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "110"
