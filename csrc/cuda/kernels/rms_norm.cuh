// GPU kernel of jakiro::rms_norm: one block per row; the residual add, the sum of squares (a
// block reduction in float32) and the scaled, weighted output, rounded where the CPU kernel
// and the checkpoints' code round.
#pragma once

#include "cuda/device.h"

namespace jakiro::gpu {

struct RmsNormParams {
  const void* x;         // [rows, H], scalar_t, contiguous
  const void* residual;  // like x, or null
  const void* weight;    // [H]
  void* out;             // [rows, H]
  void* sum;             // [rows, H]: x + residual (or x)
  int64_t rows, hidden;
  float eps;
};

constexpr int kRmsNormThreads = 256;

template <typename scalar_t>
__global__ void rms_norm_kernel(RmsNormParams p) {
  __shared__ float scratch[kRmsNormThreads / kWarp];
  const int64_t row = blockIdx.x, H = p.hidden;
  const scalar_t* x = static_cast<const scalar_t*>(p.x) + row * H;
  const scalar_t* residual = p.residual == nullptr ? nullptr : static_cast<const scalar_t*>(p.residual) + row * H;
  const scalar_t* weight = static_cast<const scalar_t*>(p.weight);
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * H;
  scalar_t* sum = static_cast<scalar_t*>(p.sum) + row * H;
  float squares = 0.f;
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
    const scalar_t v = residual == nullptr ? x[i] : from_float<scalar_t>(to_float(x[i]) + to_float(residual[i]));
    sum[i] = v;
    const float f = to_float(v);
    squares = fmaf(f, f, squares);
  }
  squares = block_sum(squares, scratch);
  const float inv = 1.f / sqrtf(squares / static_cast<float>(H) + p.eps);
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
    const float normed = to_float(from_float<scalar_t>(to_float(sum[i]) * inv));
    out[i] = from_float<scalar_t>(normed * to_float(weight[i]));
  }
}

template <typename scalar_t>
void launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  JAKIRO_LAUNCH(static_cast<unsigned>(p.rows), kRmsNormThreads, 0, stream, rms_norm_kernel<scalar_t>)(p);
}

}  // namespace jakiro::gpu
