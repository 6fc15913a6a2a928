"""The tensor-core linear (csrc/cuda/kernels/linear_wmma.cuh), which takes every bf16 linear on a
device with bf16 WMMA: each row's bits do not depend on how many rows are beside it (1..64 and
beyond, the row-count-independent split of K included), the result is the reference's within
bf16 rounding, and under the emulator (whose tensor cores sum in k order in float) exactly the
sums in the kernel's documented order. Run by `gpu_backend`: the emulator at warp widths 32 and
64, and a CUDA device when present."""
import pytest
import torch

from conftest import TOL, randn
from jakiro_ext.ops import reference

# The kernel's split of K (linear_wmma.cuh's tc_linear_splits): chunks of 64, at least 8 a split,
# splits aiming at 512 blocks of 64 output columns.
CHUNK, MIN_SPLIT_CHUNKS, TARGET_BLOCKS, COLS = 64, 8, 512, 64


def splits_of(N, K):
    chunks = -(-K // CHUNK)
    want, most = -(-TARGET_BLOCKS // max(1, -(-N // COLS))), chunks // MIN_SPLIT_CHUNKS
    return want if want < most else max(most, 1)


def emulated_tensor_core_linear(x, w, b=None, splits=None):
    """What the emulated kernel computes: per split of K, products of bf16 (exact in float)
    added in k order in float; the splits' sums added in split order; then the bias; rounded."""
    N, K = w.shape
    S, chunks = splits or splits_of(N, K), -(-K // CHUNK)
    xf, wf = x.reshape(-1, K).float(), w.float()
    total = None
    for s in range(S):
        acc = torch.zeros(xf.shape[0], N)
        for k in range(s * chunks // S * CHUNK, min(K, (s + 1) * chunks // S * CHUNK)):
            acc = acc + xf[:, k : k + 1] * wf[:, k]
        total = acc if total is None else total + acc
    if b is not None:
        total = total + b.float()
    return total.to(torch.bfloat16).reshape(*x.shape[:-1], N)


def cancelling(M, N, K, seed):
    """bf16 x [M, K] and W [N, K] whose products cancel in pairs (the second half of K repeats
    the first with W negated): the exact sums are 0 but for an odd K's last column, and what the
    float sums keep is their rounding, which any change in their order changes."""
    h = K // 2
    x = randn(M, K, seed=seed, dtype=torch.bfloat16)
    w = randn(N, K, seed=seed + 1, dtype=torch.bfloat16, scale=256.0)
    x[:, h : 2 * h], w[:, h : 2 * h] = x[:, :h], -w[:, :h]
    return x, w


@pytest.fixture(autouse=True)
def _tensor_cores_on(monkeypatch):
    monkeypatch.delenv("JAKIRO_GPU_TENSOR_CORES", raising=False)  # (a run may have switched them off)


# (N, K): K split in 2 with a 16-element tail (16-byte loads); K split in 3 with an odd length
# (element loads) and N not a multiple of 16; one chunk, N over three blocks.
SHAPES = [(80, 1048), (37, 1603), (130, 96)]


def test_the_shapes_cover_one_two_and_three_splits():
    assert [splits_of(N, K) for N, K in SHAPES] == [2, 3, 1]


@pytest.mark.parametrize("shape", SHAPES + [(16, 16), (3, 7)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_matches_reference(gpu_backend, shape):
    N, K = shape
    x = randn(2, 5, K, seed=6, dtype=torch.bfloat16)
    w = randn(N, K, seed=7, dtype=torch.bfloat16, scale=K**-0.5)
    b = randn(N, seed=8, dtype=torch.bfloat16)
    got = gpu_backend.run("linear", x, w, b)
    assert got.shape == (2, 5, N) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference.linear(x, w, b), **TOL[torch.bfloat16])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_every_row_is_bit_identical_for_1_to_64_rows(gpu_backend, shape):
    N, K = shape
    x, w = cancelling(64, N, K, seed=1)
    b = randn(N, seed=3, dtype=torch.bfloat16)
    full = gpu_backend.run("linear", x, w, b)
    for rows in range(1, 64):
        assert torch.equal(gpu_backend.run("linear", x[:rows], w, b), full[:rows]), rows
    for row in (17, 40, 63):  # a row alone, from the middle of a tile
        assert torch.equal(gpu_backend.run("linear", x[row : row + 1], w, b), full[row : row + 1]), row


def test_rows_beyond_64_and_beyond_a_launch(gpu_backend):
    # 300 rows with K split: 5 passes of 64 rows, two launches (256 rows, then 44).
    N, K = 64, 1040
    x, w = cancelling(300, N, K, seed=4)
    full = gpu_backend.run("linear", x, w)
    for lo, hi in ((0, 1), (63, 66), (250, 262), (299, 300)):
        assert torch.equal(gpu_backend.run("linear", x[lo:hi], w), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("shape", SHAPES + [(16, 16), (3, 7)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_sums_in_the_documented_order(gpu_backend, shape):
    if gpu_backend.name == "cuda":
        pytest.skip("a GPU's tensor cores round their sums their own way (the emulator's: in k order)")
    N, K = shape
    x, w = cancelling(10, N, K, seed=6)
    b = randn(N, seed=8, dtype=torch.bfloat16)
    got = gpu_backend.run("linear", x, w, b)
    assert torch.equal(got, emulated_tensor_core_linear(x, w, b))
    if K > CHUNK:  # the inputs see the order: another split of K gives other bits
        assert not torch.equal(got, emulated_tensor_core_linear(x, w, b, splits=splits_of(N, K) % 3 + 1))


def test_unaligned_rows_take_element_loads_with_the_same_bits(gpu_backend):
    # x and W one element into their storage: not 16-byte aligned, so element loads; the bits
    # are those of the aligned copies (16-byte loads).
    N, K = 48, 528
    xs = randn(9 * K + 1, seed=9, dtype=torch.bfloat16)
    ws = randn(N * K + 1, seed=10, dtype=torch.bfloat16, scale=K**-0.5)
    x, w = xs[1:].view(9, K), ws[1:].view(N, K)
    assert x.data_ptr() % 16 != 0 and w.data_ptr() % 16 != 0
    assert torch.equal(gpu_backend.run("linear", x, w), gpu_backend.run("linear", x.clone(), w.clone()))


def test_non_finite_values_reach_only_their_row_and_column(gpu_backend):
    N, K = 40, 200
    x = randn(20, K, seed=11, dtype=torch.bfloat16)
    w = randn(N, K, seed=12, dtype=torch.bfloat16, scale=K**-0.5)
    clean = gpu_backend.run("linear", x, w)
    x[3, 7], w[11, 150] = float("nan"), float("inf")
    got = gpu_backend.run("linear", x, w)
    others = torch.ones(20, N, dtype=torch.bool)
    others[3, :], others[:, 11] = False, False
    assert bool(got[3].float().isnan().all())
    assert torch.equal(got[others], clean[others])
    assert bool(got[torch.arange(20) != 3, 11].float().isinf().all())  # one infinite product: +-inf, not NaN


def test_the_cuda_core_switch_takes_effect(gpu_backend, monkeypatch):
    # Row 0 against output 0 cancels: +2^20 first, -2^20 last, 1046 terms of 2^-5 between, each
    # under half a unit of 2^20 in float: what survives depends on the order of the sums.
    N, K = 80, 1048
    x = randn(6, K, seed=13, dtype=torch.bfloat16)
    w = randn(N, K, seed=14, dtype=torch.bfloat16, scale=K**-0.5)
    x[0] = 1.0
    w[0] = 2.0**-5
    w[0, 0], w[0, K - 1] = 2.0**20, -(2.0**20)
    tensor_cores = gpu_backend.run("linear", x, w)
    monkeypatch.setenv("JAKIRO_GPU_TENSOR_CORES", "0")
    cuda_cores = gpu_backend.run("linear", x, w)
    torch.testing.assert_close(cuda_cores[1:], reference.linear(x[1:], w), **TOL[torch.bfloat16])
    assert tensor_cores[0, 0] != cuda_cores[0, 0]  # another order of sums: the switch took effect


def test_the_kits_block_target_changes_the_split_and_keeps_rows_independent(gpu_backend, monkeypatch):
    N, K = 80, 1048  # 2 splits by default; a target of 2 blocks (one per column tile): 1
    x, w = cancelling(12, N, K, seed=15)
    default = gpu_backend.run("linear", x, w)
    monkeypatch.setenv("JAKIRO_GPU_LINEAR_BLOCKS", "2")
    one_split = gpu_backend.run("linear", x, w)
    assert not torch.equal(one_split, default)
    if gpu_backend.name != "cuda":
        assert torch.equal(one_split, emulated_tensor_core_linear(x, w, splits=1))
    assert torch.equal(gpu_backend.run("linear", x[5:7], w), one_split[5:7])
    for bad in ("0", "x", "2.5"):
        monkeypatch.setenv("JAKIRO_GPU_LINEAR_BLOCKS", bad)
        with pytest.raises(RuntimeError, match="JAKIRO_GPU_LINEAR_BLOCKS must be an integer"):
            gpu_backend.run("linear", x, w)


def test_empty_shapes(gpu_backend):
    # No rows, no output features, no input features (the output is the bias, rounded).
    for x_shape, w_shape in (((0, 16), (5, 16)), ((2, 0, 16), (5, 16)), ((3, 16), (0, 16)), ((3, 0), (4, 0))):
        x = randn(*x_shape, seed=16, dtype=torch.bfloat16)
        w = randn(*w_shape, seed=17, dtype=torch.bfloat16)
        b = randn(w_shape[0], seed=18, dtype=torch.bfloat16)
        got = gpu_backend.run("linear", x, w, b)
        assert got.shape == (*x_shape[:-1], w_shape[0]) and torch.equal(got, reference.linear(x, w, b))
