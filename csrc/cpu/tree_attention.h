// The CPU tree attention's split-KV task, shared by jakiro::tree_attention (tree_attention.cpp)
// and the CPU decoder layer, which runs the tasks inside its own parallel region.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "jakiro/softmax.h"
#include "ops.h"

namespace jakiro::cpu {

constexpr int64_t kBlock = 512;        // keys per GEMM block: the [G*T, kBlock] scores stay in L2
constexpr int64_t kMinSplitLen = 512;  // automatic splits are at least this many keys long
// Up to this many tree tokens per sequence (decoding, draft trees), the automatic splits are
// kMinSplitLen keys each, counted from each sequence's first key: a sequence's result depends
// on its own length only, never on the batch it shares a call with. Longer runs (a prompt's
// chunk) go in tiles of kTileTokens tokens: a tile reads the keys up to the last one its rows see
// (a causal chunk: about half of the chunk's own), and the tiles spread the work over the
// workers (the keys are split too only where the tiles are too few tasks for them).
constexpr int64_t kFixedSplitTreeLen = 64;
constexpr int64_t kTileTokens = 64;

// The tokens of a tile of a run of tree_len tokens (all of them up to kFixedSplitTreeLen).
inline int64_t tile_tokens(int64_t tree_len) {
  return tree_len > kFixedSplitTreeLen ? kTileTokens : std::max<int64_t>(1, tree_len);
}

// Splits of kMinSplitLen keys over the longest sequence's max_kv keys (trees of at most
// kFixedSplitTreeLen tokens).
inline int64_t fixed_splits(int64_t max_kv) { return std::max<int64_t>(1, (max_kv + kMinSplitLen - 1) / kMinSplitLen); }

// Per-thread buffers. k and v hold a block of bf16 keys/values widened to float32 (`widens`: a bf16 cache); a float32
// cache is read in place, so they stay empty (zeroing 2 x 128 KB a call cost more than the
// attention of a decoding step).
struct SplitScratch {
  std::vector<float> q, scores, acc, k, v;
  std::vector<OnlineSoftmax> state;
  // A tree's (T <= kFixedSplitTreeLen): each token's visible tree keys and their count, every
  // row's scores of the tree keys, a token's visible values gathered (float32). Sized per call.
  std::vector<int64_t> visible, visible_count;
  std::vector<float> tree_scores, tree_values;
  SplitScratch() = default;
  SplitScratch(int64_t rows, int64_t dim, bool widens) { resize(rows, dim, widens); }
  void resize(int64_t rows, int64_t dim, bool widens) {
    q.resize(rows * dim);
    scores.resize(rows * kBlock);
    acc.resize(rows * dim);
    k.resize(widens ? kBlock * dim : 0);
    v.resize(widens ? kBlock * dim : 0);
    state.resize(rows);
  }
};

struct PartialArgs {
  TreeAttentionShape shape;
  int64_t num_splits;
  int64_t split_len;  // keys per split; 0: each sequence's keys in num_splits even parts
  float scale;
  const int64_t* prefix_lens;
  const int64_t* tree_mask;  // [B, T, mask_stride] contiguous
  int64_t mask_stride;
  float* out_partial;  // [B, T, Hq, splits, D]
  float* lse_partial;  // [B, T, Hq, splits]
};

// One task: sequence b, KV head kvh, split `split` of its keys, for the query heads [g0, g1) of
// the G sharing the KV head and the tree tokens [t0, t1) (all T of them, or a prompt chunk's tile:
// then only the keys up to the last one the tile's mask rows set are read); writes their rows of
// a.out_partial and a.lse_partial. A row's result is the same bits whatever rows share its task.
// cache_t: the cache's dtype, scalar_t's or bf16 beside float32 queries (check_cache_dtype).
template <typename scalar_t, typename cache_t = scalar_t>
void attend_one_split(const PartialArgs& a, const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache,
                      int64_t k_batch_stride, int64_t k_head_stride, int64_t b, int64_t kvh, int64_t split,
                      int64_t t0, int64_t t1, int64_t g0, int64_t g1, SplitScratch& s);

// A worker's share of a decoding step's or a tree's attention: units [u0, u1) of the query heads
// of the (sequence, KV head, split) tasks, G to a task, in order; run(task, g0, g1) once per task
// the share touches, for its heads [g0, g1) there. A task's heads read its keys and values once
// (the default model's 3 KV heads of 3 query heads on 2 workers: 4 and 5 heads, one KV head's
// keys read by both, where one-head tasks read them once a head). A row's result is the same
// bits whatever heads share its call (attend_one_split).
template <typename Run>
inline void for_query_head_runs(int64_t u0, int64_t u1, int64_t G, Run&& run) {
  for (int64_t u = u0; u < u1;) {
    const int64_t g0 = u % G, g1 = std::min(G, g0 + (u1 - u));
    run(u / G, g0, g1);
    u += g1 - g0;
  }
}

}  // namespace jakiro::cpu
