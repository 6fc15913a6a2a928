// Streaming top-k selection shared by the CPU and GPU head kernels. Framework-free, host/device.
#pragma once

#include "jakiro/common.h"

namespace jakiro {

// Order of candidates: larger value first; on equal values the smaller index first.
JAKIRO_HOST_DEVICE bool ranks_before(float value, int64_t index, float other_value, int64_t other_index) {
  return value > other_value || (value == other_value && index < other_index);
}

// The k best (value, index) pairs seen so far, kept sorted by `ranks_before` in caller-owned
// arrays of length k. Insertion is O(k), and O(1) for the common case of a candidate that
// does not make the list.
struct TopK {
  float* values;
  int64_t* indices;
  int64_t k;
  int64_t count = 0;

  JAKIRO_HOST_DEVICE TopK(float* v, int64_t* i, int64_t k_) : values(v), indices(i), k(k_) {}

  // Smallest value that can still enter the list (-inf until it is full).
  JAKIRO_HOST_DEVICE float threshold() const { return count < k ? -__builtin_huge_valf() : values[k - 1]; }

  JAKIRO_HOST_DEVICE void push(float value, int64_t index) {
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

}  // namespace jakiro
