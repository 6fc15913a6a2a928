"""Cases of linear and moe_top2 shared by their CPU tests (ops/) and GPU tests (gpu/)."""
import torch

from conftest import TOL, randn

# (leading dims of x, in features K, out features N): odd sizes, 1..200 rows (both sides of the
# 64-row float32 BLAS crossover), the SmolLM2 projections and LM head.
LINEAR_SHAPES = [((1,), 1, 1), ((3,), 17, 5), ((2, 5), 54, 97), ((1, 7), 576, 1536), ((60,), 576, 576), ((64,), 111, 130),
          ((65,), 64, 33), ((2, 100), 96, 211), ((4,), 576, 49152)]


def make_moe(lead, H, I, N, dtype, seed):
    x = randn(*lead, H, seed=seed, dtype=dtype)
    router = randn(N + 2, H, seed=seed + 1, dtype=dtype, scale=H**-0.5)
    w_gate = randn(N, I, H, seed=seed + 2, dtype=dtype, scale=H**-0.5)
    w_up = randn(N, I, H, seed=seed + 3, dtype=dtype, scale=H**-0.5)
    w_down = randn(N, H, I, seed=seed + 4, dtype=dtype, scale=I**-0.5)
    return x, router, w_gate, w_up, w_down


def assert_moe_close(got, want, dtype):
    out, expert_out, idx, score, contrast = got
    r_out, r_expert_out, r_idx, r_score, r_contrast = want
    assert torch.equal(idx, r_idx)  # integer outputs: exact
    assert out.dtype == dtype and expert_out.dtype == dtype and idx.dtype == torch.int64
    torch.testing.assert_close(score, r_score, **TOL[torch.float32])
    torch.testing.assert_close(contrast, r_contrast, **TOL[torch.float32])
    torch.testing.assert_close(expert_out.float(), r_expert_out.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), r_out.float(), **TOL[dtype])


# (leading dims of x, hidden, expert width, experts)
# ((40,), .., 2): every expert gets >= 16 tokens, the float32 BLAS path (cpu/gemm.h)
MOE_SHAPES = [((1,), 64, 64, 2), ((2, 13), 54, 97, 5), ((60,), 128, 111, 8), ((3, 1, 7), 96, 17, 3), ((4,), 576, 576, 8),
          ((40,), 64, 48, 2)]
