// Online softmax and split-KV merge: the arithmetic that every attention kernel
// (CPU and GPU) shares. Framework-free, host/device.
#pragma once

#include <cmath>
#include <limits>

#include "jakiro/common.h"

namespace jakiro {

JAKIRO_HOST_DEVICE float neg_inf() { return -std::numeric_limits<float>::infinity(); }
JAKIRO_HOST_DEVICE float quiet_nan() { return std::numeric_limits<float>::quiet_NaN(); }

// NaN semantics of every softmax (README, "Non-finite values"): a NaN or +inf score poisons
// its row, whose outputs become NaN; -inf scores are masked out and contribute nothing.
JAKIRO_HOST_DEVICE bool poisons(float score) { return !(score < std::numeric_limits<float>::infinity()); }

// Running state of a softmax over a stream of scores: max seen and sum of exp(score - max).
struct OnlineSoftmax {
  float max = neg_inf();
  float sum = 0.f;

  // Fold in a block whose maximum score is `block_max`. Returns the factor by which
  // everything accumulated so far (the sum and the weighted values) must be scaled; the
  // caller then adds the block's exp(score - this->max) terms to `sum` itself.
  JAKIRO_HOST_DEVICE float rescale_for(float block_max) {
    const float new_max = block_max > max ? block_max : max;
    // max == -inf means nothing accumulated yet: the factor is irrelevant, use 0 to avoid NaN.
    const float factor = (max == neg_inf()) ? 0.f : expf(max - new_max);
    max = new_max;
    sum *= factor;
    return factor;
  }

  // A poisoned state (it saw a NaN or +inf score) keeps sum = NaN through every rescale.
  JAKIRO_HOST_DEVICE void poison() { sum = quiet_nan(); }
  JAKIRO_HOST_DEVICE bool poisoned() const { return sum != sum; }

  // log-sum-exp of every score seen; -inf if none (or all masked); NaN once poisoned.
  JAKIRO_HOST_DEVICE float lse() const { return sum == 0.f ? neg_inf() : max + logf(sum); }
  // Factor that normalises the accumulated values: 1 / sum (NaN once poisoned), 0 if empty.
  JAKIRO_HOST_DEVICE float inv_sum() const { return sum == 0.f ? 0.f : 1.f / sum; }
};

// Weights for merging split-KV partial results: partial s contributes
// exp(lse_s - lse_total) * out_s. `max_lse` must be the largest lse_s.
// Returns exp(lse_s - max_lse), 0 for an empty split (lse_s = -inf).
JAKIRO_HOST_DEVICE float merge_weight(float lse_s, float max_lse) {
  return lse_s == neg_inf() ? 0.f : expf(lse_s - max_lse);
}

}  // namespace jakiro
