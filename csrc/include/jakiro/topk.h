// Streaming top-k selection shared by the CPU and GPU head kernels. Framework-free, host/device.
#pragma once

#include "jakiro/common.h"

namespace jakiro {

// Order of candidates: larger value first; on equal values the smaller index first.
template <typename value_t>
JAKIRO_HOST_DEVICE bool ranks_before(value_t value, int64_t index, value_t other_value, int64_t other_index) {
  return value > other_value || (value == other_value && index < other_index);
}

// The k best (value, index) pairs seen so far, kept sorted by `ranks_before` in caller-owned
// arrays of length k. Insertion is O(k), and O(1) for the common case of a candidate that
// does not make the list. value_t: float (logits), double (the GPU sampling filters).
template <typename value_t>
struct BasicTopK {
  value_t* values;
  int64_t* indices;
  int64_t k;
  int64_t count = 0;

  JAKIRO_HOST_DEVICE BasicTopK(value_t* v, int64_t* i, int64_t k_) : values(v), indices(i), k(k_) {}

  // Smallest value that can still enter the list (-inf until it is full).
  JAKIRO_HOST_DEVICE value_t threshold() const {
    return count < k ? -static_cast<value_t>(__builtin_huge_val()) : values[k - 1];
  }

  JAKIRO_HOST_DEVICE void push(value_t value, int64_t index) {
    if (count == k && !ranks_before(value, index, values[k - 1], indices[k - 1])) return;
    int64_t pos = count < k ? count++ : k - 1;
    while (pos > 0 && ranks_before(value, index, values[pos - 1], indices[pos - 1])) {
      values[pos] = values[pos - 1];
      indices[pos] = indices[pos - 1];
      --pos;
    }
    values[pos] = value;
    indices[pos] = index;
  }
};
using TopK = BasicTopK<float>;

}  // namespace jakiro
