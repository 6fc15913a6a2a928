// GPU kernel of jakiro::mlp_heads: Gumiho's parallel MLP heads. Each layer of every head reads
// the whole previous layer, so a layer is one launch for all the heads (grid: tiles of output
// columns x heads; 1 + NB launches, against 3 per layer and head unfused): each block streams its
// weight rows once with the skinny GEMM and applies the bias, the SiLU and the residual in the
// epilogue. Activations stay float32 in two scratch buffers [2, J, M, H] (a layer reads one and
// writes the other); the last layer also writes the output in x's dtype, rounded once.
#pragma once

#include "cuda/device.h"
#include "cuda/kernels/skinny_gemm.cuh"

namespace jakiro::gpu {

struct MlpHeadsParams {
  const void* x;         // [M, K], scalar_t, contiguous
  const void* w_in;      // [J, H, K], scalar_t
  const void* b_in;      // [J, H], scalar_t
  const void* w_blocks;  // [J, NB, H, H], scalar_t
  const void* b_blocks;  // [J, NB, H], scalar_t
  float* act;            // [2, J, M, H] float32 scratch
  void* out;             // [M, J, H], scalar_t
  int64_t M, K, J, H, NB;
  int64_t tile;  // output columns per block: set by launch_mlp_heads
};

constexpr int kMlpHeadsThreads = 128;

// Layer `layer` of head blockIdx.y over the block's columns: layer 0 reads x, layer b + 1 (block
// b) the buffer `src`; both write the other buffer, and the last one the output too.
template <typename scalar_t>
__global__ void mlp_heads_layer_kernel(MlpHeadsParams p, int64_t layer, int src, bool last) {
  const int64_t j = blockIdx.y, M = p.M, H = p.H, J = p.J;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * p.tile;
  const int64_t c1 = c0 + p.tile < H ? c0 + p.tile : H;
  const float* in = p.act + (src * J + j) * M * H;
  float* dst = p.act + ((1 - src) * J + j) * M * H;
  scalar_t* out = static_cast<scalar_t*>(p.out);
  auto store = [=](int64_t r, int64_t c, float v) {
    dst[r * H + c] = v;
    if (last) out[(r * J + j) * H + c] = from_float<scalar_t>(v);
  };
  if (layer == 0) {
    const int64_t K = p.K;
    const scalar_t* x = static_cast<const scalar_t*>(p.x);
    const scalar_t* bias = static_cast<const scalar_t*>(p.b_in) + j * H;
    const WeightSet<scalar_t, 1> W{{static_cast<const scalar_t*>(p.w_in) + j * H * K}, K};
    skinny_gemm_tile(
        W, K, c0, c1, M, [=](int64_t r) { return x + r * K; },
        [=](int64_t r, int64_t c, const float* v) { store(r, c, silu(v[0] + to_float(bias[c]))); });
  } else {
    const int64_t at = j * p.NB + (layer - 1);  // (head, block)
    const scalar_t* bias = static_cast<const scalar_t*>(p.b_blocks) + at * H;
    const WeightSet<scalar_t, 1> W{{static_cast<const scalar_t*>(p.w_blocks) + at * H * H}, H};
    skinny_gemm_tile(
        W, H, c0, c1, M, [=](int64_t r) { return in + r * H; },
        [=](int64_t r, int64_t c, const float* v) { store(r, c, in[r * H + c] + silu(v[0] + to_float(bias[c]))); });
  }
}

template <typename scalar_t>
void launch_mlp_heads(const MlpHeadsParams& params, cudaStream_t stream) {
  if (params.M == 0 || params.J == 0 || params.H == 0) return;
  MlpHeadsParams p = params;
  p.tile = skinny_tile_rows(p.H, kMlpHeadsThreads / kWarp);
  const dim3 grid(static_cast<unsigned>((p.H + p.tile - 1) / p.tile), static_cast<unsigned>(p.J));
  int src = 1;  // layer 0 writes buffer 0
  for (int64_t layer = 0; layer <= p.NB; ++layer, src = 1 - src) {
    JAKIRO_LAUNCH(grid, kMlpHeadsThreads, 0, stream, mlp_heads_layer_kernel<scalar_t>)(p, layer, src, layer == p.NB);
  }
}

}  // namespace jakiro::gpu
