// GPU kernel of KV compaction: move each sequence's accepted tree entries (tree indices
// path[b, :path_len[b]], strictly increasing) to positions prefix + 0, 1, ... in place.
//
// One block per (outer index, sequence, head) slab of the cache. The rows are moved in path
// order and every thread owns the same words of every row, so the only overlap (a destination
// that was an earlier row's source) is ordered by each thread's own program order: no barrier.
#pragma once

#include "cuda/device.h"

namespace jakiro::gpu {

struct CompactKvParams {
  void* cache;                 // [slabs, S, row_bytes] where slab = (outer, b, h)
  const int64_t* prefix_lens;  // [B]
  const int64_t* path;         // [B, path_width]
  const int64_t* path_len;     // [B]
  int64_t slabs, batch, heads, capacity, row_bytes, path_width;
  int32_t* errors;             // the device's error word
};

// Whether sequence b's move stays inside the cache: 0 <= path_len <= path_width, prefix >= 0 and
// path strictly increasing from >= 0 to < capacity - prefix (what the CPU op checks on the host).
JAKIRO_DEVICE bool valid_path(const CompactKvParams& p, int64_t b) {
  const int64_t prefix = p.prefix_lens[b], len = p.path_len[b];
  if (len < 0 || len > p.path_width || prefix < 0) return false;
  int64_t last = -1;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t src = p.path[b * p.path_width + j];
    if (src <= last || src >= p.capacity - prefix) return false;
    last = src;
  }
  return true;
}

struct alignas(16) Words16 {
  uint64_t lo, hi;
};

template <typename word_t>
__global__ void compact_kv_kernel(CompactKvParams p) {
  const int64_t slab = blockIdx.x;
  const int64_t b = (slab / p.heads) % p.batch;
  const int64_t words = p.row_bytes / static_cast<int64_t>(sizeof(word_t));
  word_t* rows = reinterpret_cast<word_t*>(static_cast<unsigned char*>(p.cache) + slab * p.capacity * p.row_bytes);
  if (!valid_path(p, b)) {  // (the same answer in every thread: nothing moves)
    if (threadIdx.x == 0) report_error(p.errors, kBadPath);
    return;
  }
  const int64_t prefix = p.prefix_lens[b], len = p.path_len[b];
  for (int64_t j = 0; j < len; ++j) {
    const int64_t src = prefix + p.path[b * p.path_width + j], dst = prefix + j;
    if (src == dst) continue;
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) rows[dst * words + w] = rows[src * words + w];
  }
}

inline void launch_compact_kv(const CompactKvParams& p, cudaStream_t stream) {
  if (p.slabs == 0 || p.row_bytes == 0) return;
  // The widest word that divides the rows and the base address.
  const auto base = reinterpret_cast<uintptr_t>(p.cache);
  auto fits = [&](int64_t bytes) { return p.row_bytes % bytes == 0 && base % bytes == 0; };
  const int64_t word = fits(16) ? 16 : fits(8) ? 8 : fits(4) ? 4 : fits(2) ? 2 : 1;
  const int64_t words = p.row_bytes / word;
  const int threads = static_cast<int>(words >= 256 ? 256 : ceil_div(words, kWarp) * kWarp);
  const unsigned grid = static_cast<unsigned>(p.slabs);
  switch (word) {
    case 16: JAKIRO_LAUNCH(grid, threads, 0, stream, compact_kv_kernel<Words16>)(p); break;
    case 8: JAKIRO_LAUNCH(grid, threads, 0, stream, compact_kv_kernel<uint64_t>)(p); break;
    case 4: JAKIRO_LAUNCH(grid, threads, 0, stream, compact_kv_kernel<uint32_t>)(p); break;
    case 2: JAKIRO_LAUNCH(grid, threads, 0, stream, compact_kv_kernel<uint16_t>)(p); break;
    default: JAKIRO_LAUNCH(grid, threads, 0, stream, compact_kv_kernel<unsigned char>)(p); break;
  }
}

}  // namespace jakiro::gpu
