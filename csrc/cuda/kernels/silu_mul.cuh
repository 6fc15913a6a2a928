// GPU kernel of jakiro::silu_mul: SiLU(gate) * up of a fused [rows, 2 I] projection ([gate | up]),
// in float32 and rounded once, as the CPU kernel. One block per row, its threads striding over I.
#pragma once

#include "cuda/device.h"

namespace jakiro::gpu {

struct SiluMulParams {
  const void* gate_up;  // [rows, 2 I], contiguous
  void* out;            // [rows, I]
  int64_t rows, inner;  // inner: I
};

constexpr int kSiluMulThreads = 256;

template <typename scalar_t>
__global__ void silu_mul_kernel(SiluMulParams p) {
  const int64_t row = blockIdx.x, I = p.inner;
  const scalar_t* gate = static_cast<const scalar_t*>(p.gate_up) + row * 2 * I;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * I;
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
    out[i] = from_float<scalar_t>(silu(to_float(gate[i])) * to_float(gate[I + i]));
  }
}

template <typename scalar_t>
void launch_silu_mul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  JAKIRO_LAUNCH(static_cast<unsigned>(p.rows), kSiluMulThreads, 0, stream, silu_mul_kernel<scalar_t>)(p);
}

}  // namespace jakiro::gpu
