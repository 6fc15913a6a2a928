"""GPU kernels of contrastive_topk and verify_tree (csrc/cuda/kernels/{contrastive_topk,verify_tree,
block_topk}.cuh) against the references, under the SIMT emulator (warp widths 32 and 64) and on
a CUDA device when there is one. Shapes are the CPU tests' where the emulator runs them quickly,
smaller otherwise; integer outputs must match exactly (sampling included, with given uniforms)."""
import pytest
import torch

from conftest import randn
from jakiro_ext.ops import quantized, reference
from op_cases.head_verify import CONTRASTIVE_SHAPES as HEAD_SHAPES
from op_cases.head_verify import SAMPLING_FILTERS, assert_same, contrast_weights, make_tree

# ----------------------------------------------------------------------------- contrastive_topk
# The CPU test's shapes up to V = 1000 (larger ones are slow to emulate), plus: k over one
# selection round (16) and over several, V not a multiple of the vocabulary tile (64), rows
# over one row tile (8) and k = V.
EMU_HEAD_SHAPES = [s for s in HEAD_SHAPES if s[2] <= 1000] + [
    ((2,), 40, 130, 17),
    ((11,), 24, 333, 50),
    ((1,), 16, 65, 65),
    ((2, 3), 8, 200, 33),
]


def _head_inputs(lead, H, V, dtype, contrastive, seed=1):
    h_a = randn(*lead, H, seed=seed, dtype=dtype)
    lm_head = randn(V, H, seed=seed + 1, dtype=dtype, scale=H**-0.5)
    h_b = randn(*lead, H, seed=seed + 2, dtype=dtype) if contrastive else None
    w = contrast_weights(lead, seed=seed + 3) if contrastive else None
    return h_a, h_b, w, lm_head


def _check_head(got, want, k, lead):
    logprobs, ids = got
    assert logprobs.shape == (*lead, k) and logprobs.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, want[1])
    # Logits are computed in float32 from the given (possibly bf16) inputs on both sides.
    torch.testing.assert_close(logprobs, want[0], atol=1e-4, rtol=1e-5)
    assert torch.all(logprobs[..., :-1] >= logprobs[..., 1:])


@pytest.mark.parametrize("contrastive", [False, True], ids=["plain", "contrastive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", EMU_HEAD_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}-V{s[2]}-k{s[3]}")
def test_gpu_contrastive_topk_matches_reference(gpu_backend, shape, dtype, contrastive):
    lead, H, V, k = shape
    args = _head_inputs(lead, H, V, dtype, contrastive)
    got = gpu_backend.run("contrastive_topk", *args, k)
    _check_head(got, reference.contrastive_topk(*args, k), k, lead)


def test_gpu_contrastive_topk_ties_and_noncontiguous(gpu_backend):
    # Equal logits (duplicated LM-head rows): ties go to the lower token id, across rounds.
    lm_head = randn(20, 16, seed=30).repeat(6, 1)  # V = 120, every logit six times
    h_a = randn(16, 3, seed=31).t()  # [3, 16], transposed strides
    got = gpu_backend.run("contrastive_topk", h_a, None, None, lm_head, 40)
    want = reference.contrastive_topk(h_a, None, None, lm_head, 40)
    ids = got[1]
    for r in range(3):  # the reference's topk makes no promise on ties: check the order directly
        logits = (h_a[r] @ lm_head.T)[ids[r]]
        order = sorted(range(40), key=lambda j: (-float(logits[j]), int(ids[r, j])))
        assert order == list(range(40))
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)


def test_gpu_contrastive_feature_and_empty_rows(gpu_backend):
    h_a, h_b = randn(6, 40, seed=5), randn(6, 40, seed=6)
    w = contrast_weights((6,), seed=7).bfloat16()  # contrast weights may be bf16 with float32 features
    lm_head = randn(300, 40, seed=8)
    got = gpu_backend.run("contrastive_topk", h_a, h_b, w, lm_head, 5)
    _check_head(got, reference.contrastive_topk(h_a, h_b, w, lm_head, 5), 5, (6,))
    empty = gpu_backend.run("contrastive_topk", h_a[:0], None, None, lm_head, 3)
    assert empty[0].shape == (0, 3) and empty[1].shape == (0, 3)


def test_gpu_contrastive_topk_refuses_a_bf16_lm_head_beside_float32_features(gpu_backend):
    # The CPU kernel reads a bf16 LM head beside float32 features; the GPU's takes one dtype and says so.
    h_a, lm_head = randn(3, 32, seed=40), randn(100, 32, seed=41, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"lm_head in bfloat16 beside float32 h_a is read by the CPU kernels only"):
        gpu_backend.run("contrastive_topk", h_a, None, None, lm_head, 3)
    # ... and a packed quantized one (a GGUF target's rows), which only the CPU kernel reads.
    packed = quantized.from_float(randn(96, 32, seed=42), "Q8_0")
    with pytest.raises(RuntimeError, match=r"lm_head is a packed quantized weight \(uint8\), which only the CPU kernels read"):
        gpu_backend.run("contrastive_topk", h_a, None, None, packed, 3)


@pytest.mark.parametrize("V,k,ties", [(4099, 7, False), (4099, 64, True), (4097, 10, False), (4099, 65, False),
                                      (9000, 70, False)])
def test_gpu_contrastive_topk_long_rows(gpu_backend, V, k, ties):
    # k <= 64 and V >= 4096: the split top-k (slices of 2048, a last one shorter than k for
    # V = 4097); larger k: one block per row (1024 threads for V >= 8192).
    h_a = randn(2, 8, seed=21)
    lm_head = randn(V, 8, seed=22, scale=0.3)
    if ties:  # equal LM-head rows across slices: equal logits, ranked by token id
        lm_head[torch.arange(V // 2, V, 97)] = h_a[0] * 0.5  # at the top of row 0's logits
    got = gpu_backend.run("contrastive_topk", h_a, None, None, lm_head, k)
    want = reference.contrastive_topk(h_a, None, None, lm_head, k)
    if not ties:
        _check_head(got, want, k, (2,))
        return
    logprobs, ids = got  # the reference's topk makes no promise on ties: check the order directly
    torch.testing.assert_close(logprobs, want[0], atol=1e-4, rtol=1e-5)
    full = torch.log_softmax(h_a.double() @ lm_head.double().T, -1)
    for r in range(2):
        assert len(set(ids[r].tolist())) == k
        torch.testing.assert_close(full[r, ids[r]], logprobs[r].double(), atol=1e-4, rtol=1e-5)
        for j in range(k - 1):
            assert logprobs[r, j] > logprobs[r, j + 1] or ids[r, j] < ids[r, j + 1]
    assert any(int((logprobs[r] == logprobs[r, j]).sum()) > 1 for r in range(2) for j in range(k))  # ties were hit


def test_gpu_contrastive_topk_unaligned_head(gpu_backend):
    # An LM head whose rows are not 16-byte aligned: the logits kernel's element-wise loads
    # (H = 16 would take 16-byte loads otherwise).
    for dtype in (torch.float32, torch.bfloat16):
        flat = randn(300 * 16 + 3, seed=23, dtype=dtype)
        lm = flat[3:].view(300, 16)  # contiguous, 12 (6) bytes past an aligned address
        h = randn(3, 16, seed=24, dtype=dtype)
        got = gpu_backend.run("contrastive_topk", h, None, None, lm, 4)
        _check_head(got, reference.contrastive_topk(h, None, None, lm, 4), 4, (3,))


def test_gpu_contrastive_topk_bad_input_errors(gpu_backend):
    h_a, lm_head = randn(3, 32, seed=13), randn(100, 32, seed=16)
    with pytest.raises(RuntimeError, match=r"k must be in \[1, vocab size 100\], got 101"):
        gpu_backend.run("contrastive_topk", h_a, None, None, lm_head, 101)
    with pytest.raises(RuntimeError, match=r"h_b and contrast_weight go together"):
        gpu_backend.run("contrastive_topk", h_a, h_a, None, lm_head, 3)


# ----------------------------------------------------------------------------- verify_tree
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,V", [(1, 1, 5), (3, 60, 97), (2, 26, 1000), (1, 40, 3001)])
def test_gpu_verify_tree_matches_reference_greedy(gpu_backend, B, T, V, dtype):
    parents, tokens, logits, _ = make_tree(B, T, V, seed=T + V, dtype=dtype)
    got = gpu_backend.run("verify_tree", parents, tokens, logits)
    assert_same(got, reference.verify_tree(parents, tokens, logits))
    if T >= 26 and V <= 1000:
        assert int(got[1].max()) >= 1  # the planted paths are found (as in the CPU test)


def test_gpu_verify_tree_greedy_ties(gpu_backend):
    # Non-finite logits: test_nonfinite.py.
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    tokens = torch.tensor([[0, 3, 5, 2], [0, 7, 7, 7]])
    logits = torch.zeros(2, 4, 300)
    logits[0, 0, [5, 3, 290]] = 2.0  # tie: lowest id (3) wins
    logits[0, 1, [2, 100]] = 1.0
    logits[0, 1, 50] = float("-inf")  # a masked token
    logits[1, :, 7] = 1.0
    got = gpu_backend.run("verify_tree", parents, tokens, logits)
    assert got[0].tolist() == [[0, 1, 3, -1], [0, 1, 2, 3]]
    assert got[1].tolist() == [2, 3] and got[2].tolist() == [0, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,top_p,top_k", SAMPLING_FILTERS)
@pytest.mark.parametrize("B,T,V", [(4, 1, 7), (6, 60, 97), (2, 26, 5000)])
def test_gpu_verify_tree_matches_reference_sampling(gpu_backend, B, T, V, temperature, top_p, top_k, dtype):
    parents, tokens, logits, uniforms = make_tree(B, T, V, seed=3 * T + V, dtype=dtype)
    got = gpu_backend.run("verify_tree", parents, tokens, logits, uniforms, temperature, top_p, top_k)
    assert_same(got, reference.verify_tree(parents, tokens, logits, uniforms, temperature, top_p, top_k))


# Filters at their edges: top-k over several selection rounds (32 each) and by bisection (over
# 8 rounds), top_k = V - 1, V and more (off), top-p with a large kept set (bisection, then
# rounds), both together; V >= 8192 takes the 1024-thread sampling kernel.
EDGE_FILTERS = [
    (97, 1.0, 1.0, 33), (97, 0.9, 1.0, 96), (97, 1.0, 1.0, 97), (97, 1.0, 1.0, 500), (97, 2.0, 0.97, 0),
    (97, 1.2, 0.6, 70), (1000, 1.0, 1.0, 600), (1000, 0.9, 0.95, 300), (1000, 1.5, 0.9, 0), (9000, 1.0, 0.9, 0),
    (9000, 0.8, 1.0, 40), (9000, 1.0, 1.0, 2000),
]


@pytest.mark.parametrize("V,temperature,top_p,top_k", EDGE_FILTERS)
def test_gpu_verify_tree_sampling_filter_edges(gpu_backend, V, temperature, top_p, top_k):
    B, T = (3, 30) if V < 9000 else (1, 8)
    parents, tokens, logits, uniforms = make_tree(B, T, V, seed=41)
    got = gpu_backend.run("verify_tree", parents, tokens, logits, uniforms, temperature, top_p, top_k)
    assert_same(got, reference.verify_tree(parents, tokens, logits, uniforms, temperature, top_p, top_k))


@pytest.mark.parametrize("top_p,top_k", [(0.5, 0), (1.0, 3), (0.7, 5)])
def test_gpu_verify_tree_sampling_tied_logits(gpu_backend, top_p, top_k):
    # Equal probabilities: top-p keeps the lower ids first, top-k keeps every tie of the k-th.
    parents = torch.tensor([[-1, 0, 0, 0, 1]])
    tokens = torch.tensor([[0, 9, 9, 40, 2]])  # a duplicate sibling
    logits = torch.zeros(1, 5, 80)
    logits[0, :, ::4] = 1.0  # 20 tied top tokens, then 60 tied others
    for seed in range(4):
        uniforms = torch.rand(1, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        args = (parents, tokens, logits, uniforms, 0.8, top_p, top_k)
        assert_same(gpu_backend.run("verify_tree", *args), reference.verify_tree(*args))


def test_gpu_verify_tree_all_mass_on_the_children(gpu_backend):
    parents = torch.tensor([[-1, 0, 0]])
    tokens = torch.tensor([[0, 3, 1]])
    logits = torch.tensor([[[0.0, 1.0, -5.0, 1.2], [0.0] * 4, [0.0] * 4]])
    uniforms = torch.tensor([[0.5, 1.0 - 2**-53, 1.0 - 2**-53, 0.5]], dtype=torch.float64)
    got = gpu_backend.run("verify_tree", parents, tokens, logits, uniforms, temperature=0.7, top_k=2)
    assert_same(got, reference.verify_tree(parents, tokens, logits, uniforms, temperature=0.7, top_k=2))
    assert got[0][0, :2].tolist() == [0, 2] and int(got[1][0]) == 1


def test_gpu_verify_tree_empty_batch_and_bad_input(gpu_backend):
    parents, tokens, logits, uniforms = make_tree(2, 6, 20, seed=6)
    for args in [(parents[:0], tokens[:0], logits[:0]), (parents[:0], tokens[:0], logits[:0], uniforms[:0], 1.0)]:
        path, accept_len, bonus = gpu_backend.run("verify_tree", *args)
        assert path.shape == (0, 6) and accept_len.shape == (0,) and bonus.shape == (0,)
    with pytest.raises(RuntimeError, match=r"needs uniforms \[B, T \+ 1\] float64"):
        gpu_backend.run("verify_tree", parents, tokens, logits, None, 0.5)
    with pytest.raises(RuntimeError, match=r"top_p must be in \(0, 1\], got 0"):
        gpu_backend.run("verify_tree", parents, tokens, logits, uniforms, 0.5, 0.0)
