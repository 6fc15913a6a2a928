// GPU kernel of the split-KV merge: combine per-split attention results by their log-sum-exp.
#pragma once

#include "cuda/device.h"

namespace jakiro::gpu {

struct MergeParams {
  const float* out_partial;  // [rows, splits, dim]
  const float* lse_partial;  // [rows, splits]
  void* out;                 // [rows, dim], out_t
  float* lse;                // [rows]
  int64_t rows, splits, dim;
};

// One block per row (b, t, head); threads stride over the head dimension.
template <typename out_t>
__global__ void merge_attention_states_kernel(MergeParams p) {
  const int64_t row = blockIdx.x;
  const float* lses = p.lse_partial + row * p.splits;
  float max_lse = neg_inf();
  bool poisoned = false;  // a split saw a NaN or +inf score: the row is NaN
  for (int64_t s = 0; s < p.splits; ++s) {
    max_lse = fmaxf(max_lse, lses[s]);
    poisoned |= poisons(lses[s]);
  }
  float total = 0.f;
  if (!poisoned && max_lse != neg_inf()) {
    for (int64_t s = 0; s < p.splits; ++s) total += merge_weight(lses[s], max_lse);
  }
  out_t* out = static_cast<out_t*>(p.out);
  for (int64_t d = threadIdx.x; d < p.dim; d += blockDim.x) {
    float acc = poisoned ? quiet_nan() : 0.f;
    if (total > 0.f) {
      for (int64_t s = 0; s < p.splits; ++s) {  // an empty split (lse -inf) is not read
        if (lses[s] != neg_inf()) acc += merge_weight(lses[s], max_lse) * p.out_partial[(row * p.splits + s) * p.dim + d];
      }
      acc /= total;
    }
    out[row * p.dim + d] = from_float<out_t>(acc);
  }
  if (threadIdx.x == 0) p.lse[row] = poisoned ? quiet_nan() : total > 0.f ? max_lse + logf(total) : neg_inf();
}

template <typename out_t>
void launch_merge_attention_states(const MergeParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const int threads = static_cast<int>(p.dim < 128 ? ceil_div(p.dim, kWarp) * kWarp : 128);
  JAKIRO_LAUNCH(p.rows, threads, 0, stream, merge_attention_states_kernel<out_t>)(p);
}

}  // namespace jakiro::gpu
