// GPU kernel of jakiro::linear, y = x @ W^T (+ b): the projections and LM heads at decoding and
// tree-verification sizes, bound by reading W, which the skinny GEMM streams once. float32
// arithmetic, output in x's dtype (rounded once, after the bias).
#pragma once

#include "cuda/device.h"
#include "cuda/kernels/skinny_gemm.cuh"

namespace jakiro::gpu {

struct LinearParams {
  const void* x;       // [M, K], scalar_t, contiguous
  const void* weight;  // [N, K], scalar_t, contiguous
  const void* bias;    // [N], scalar_t, or null
  void* y;             // [M, N], scalar_t
  int64_t M, K, N;
  int64_t tile;        // weight rows per block: set by launch_linear
};

constexpr int kLinearThreads = 128;
// Weight rows a warp streams at once (skinny_gemm_tile's R) when its tile gives it at least
// that many: more loads in flight and input rows reused 4 times, for the LM head; 1 otherwise
// (fewer registers, more warps resident).
constexpr int kLinearWideColumns = 4;

// One block per tile of weight rows; every row of x is taken by each block.
template <typename scalar_t, int R>
__global__ void linear_kernel(LinearParams p) {
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* bias = static_cast<const scalar_t*>(p.bias);
  scalar_t* y = static_cast<scalar_t*>(p.y);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * p.tile;
  const int64_t j1 = j0 + p.tile < p.N ? j0 + p.tile : p.N;
  const WeightSet<scalar_t, 1> W{{static_cast<const scalar_t*>(p.weight)}, p.K};
  const int64_t K = p.K, N = p.N;
  skinny_gemm_tile<R>(
      W, K, j0, j1, p.M, [=](int64_t m) { return x + m * K; },
      [=](int64_t m, int64_t j, const float* v) {
        const float b = bias != nullptr ? to_float(bias[j]) : 0.f;
        y[m * N + j] = from_float<scalar_t>(v[0] + b);
      });
}

template <typename scalar_t>
void launch_linear(const LinearParams& params, cudaStream_t stream) {
  if (params.M == 0 || params.N == 0) return;
  LinearParams p = params;
  constexpr int warps = kLinearThreads / kWarp;
  p.tile = skinny_tile_rows(p.N, warps);
  const int64_t blocks = (p.N + p.tile - 1) / p.tile;
  if (p.tile / warps >= kLinearWideColumns) {
    JAKIRO_LAUNCH(blocks, kLinearThreads, 0, stream, linear_kernel<scalar_t, kLinearWideColumns>)(p);
  } else {
    JAKIRO_LAUNCH(blocks, kLinearThreads, 0, stream, linear_kernel<scalar_t, 1>)(p);
  }
}

}  // namespace jakiro::gpu
