// The CPU merge of split-KV partial attention states (merge_attention_states.cpp); tree
// attention ends with it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "cpu/vec_utils.h"
#include "jakiro/common.h"
#include "jakiro/softmax.h"

namespace jakiro::cpu {

// One (sequence, token, head) row of the merge: the S splits' outputs outs [S, D] weighted by
// exp(lse_s - max lse) and renormalised into out [D] (rounded to scalar_t once), the merged lse
// into *lse. An empty split (lse -inf) contributes nothing; a NaN or +inf lse poisons the row
// (NaN out and lse). acc: D floats of scratch.
template <typename scalar_t>
void merge_attention_row(const float* outs, const float* lses, int64_t S, int64_t D, float* acc, scalar_t* out,
                         float* lse) {
  float max_lse = neg_inf();
  bool poisoned = false;
  for (int64_t s = 0; s < S; ++s) {
    poisoned |= poisons(lses[s]);
    max_lse = lses[s] > max_lse ? lses[s] : max_lse;
  }
  std::fill(acc, acc + D, poisoned ? quiet_nan() : 0.f);
  float total = 0.f;
  if (!poisoned && max_lse != neg_inf()) {
    for (int64_t s = 0; s < S; ++s) {
      if (lses[s] == neg_inf()) continue;  // an empty split: its output is not read
      const float w = merge_weight(lses[s], max_lse);
      total += w;
      axpy(acc, outs + s * D, D, w);
    }
    scale_in_place(acc, D, 1.f / total);
  }
  from_float(acc, out, D);
  *lse = poisoned ? quiet_nan() : total > 0.f ? max_lse + std::log(total) : neg_inf();
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& out_partial,
                                                              const at::Tensor& lse_partial,
                                                              std::optional<at::ScalarType> out_dtype);

}  // namespace jakiro::cpu
