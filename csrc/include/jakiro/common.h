// Macros shared by host (CPU) and device (CUDA/HIP) code. Framework-free: no torch headers.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define JAKIRO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAKIRO_HOST_DEVICE inline
#endif

#include <cstdint>

namespace jakiro {

// Number of 64-bit words that hold one row of a bit-packed tree mask over `num_nodes` nodes.
JAKIRO_HOST_DEVICE int64_t mask_words(int64_t num_nodes) { return (num_nodes + 63) / 64; }

// Bit `j` of a bit-packed mask row: does the node of this row see tree node `j`?
JAKIRO_HOST_DEVICE bool mask_bit(const int64_t* row, int64_t j) {
  return (static_cast<uint64_t>(row[j >> 6]) >> (j & 63)) & 1u;
}

}  // namespace jakiro
