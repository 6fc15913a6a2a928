// GPU kernel of split-KV tree attention (FlashDecoding-style): one pass that writes, per KV
// split, each query row's partial attention output and log-sum-exp; merge_attention_states.cuh
// then combines the splits.
//
// Grid: (split, batch x KV head, chunk of query rows). The query rows of a block are the tree
// tokens x query heads of ONE KV head (GQA: every K/V load serves all of them). Inside the
// block each warp takes chunks of kWarp keys of the split in turn (lane = key):
//   * scores: the chunk's K rows pass through shared memory 32 dimensions at a time (coalesced
//     loads), each lane dots its key with every query row of the block (queries in shared memory);
//   * online softmax per row (jakiro/softmax.h), probabilities to shared memory;
//   * P @ V: lanes own head dimensions and read V rows coalesced, each V row once for all rows.
// At the end the warps' states are merged through shared memory, the same log-sum-exp merge as
// between splits.
//
// Two ways to cut the keys (TreeAttentionParams::split_len):
//   * fixed splits (> 0; a decoding step or a draft tree of at most kFixedSplitMaxTree tokens):
//     a row's keys are its own run, the prefix and then the tree keys its mask row sets in index
//     order (positions prefix + 0, 1, ...), and split s covers positions [s * split_len,
//     (s + 1) * split_len) of every row's run. A position's split, warp, chunk and lane follow from
//     the position alone, so a tree row's sums are those of the same token's one-token step with
//     its ancestors committed (their keys the prefix's last): the same bits, whatever the tree's
//     size, its siblings or the cache's capacity. A chunk that reaches past the prefix gathers
//     each row's keys (rows see different ancestors); all-prefix chunks are read once for all rows;
//   * even parts (0; a longer run, a prompt's chunk, or splits the caller chose): each sequence's prefix + T keys
//     in `splits` equal parts as they lie, the tree keys masked in place.
#pragma once

#include "cuda/device.h"

namespace jakiro::gpu {

template <typename kv_t>
struct TreeAttentionParams {
  const kv_t* q;               // [B, T, Hq, D] contiguous
  const kv_t* k_cache;         // [B, Hkv, S, D]: rows of D contiguous, strides below
  const kv_t* v_cache;         // same layout as k_cache
  const int64_t* prefix_lens;  // [B]
  const int64_t* tree_mask;    // [B, T, mask_stride]
  float* out_partial;          // [B, T, Hq, splits, D]
  float* lse_partial;          // [B, T, Hq, splits]
  int64_t batch, tree_len, q_heads, kv_heads, head_dim, splits, mask_stride;
  int64_t kv_batch_stride, kv_head_stride;
  float scale;
  int64_t capacity;  // S
  int32_t* errors;   // the device's error word
  int64_t row_block0 = 0;  // the first row block of this launch (grids of at most kMaxGridYZ in z)
  int64_t split_len = 0;   // > 0: fixed splits of each row's run (tree_len <= kFixedSplitMaxTree); 0: even parts
};

// Fixed splits: keys per split, and the longest tree they serve (a row's gathered tree keys fit
// in a block's shared memory). The CPU's kernel has the same rule (longer splits: its workers are few).
constexpr int64_t kFixedSplitLen = 256;
constexpr int64_t kFixedSplitMaxTree = 64;

// Query rows of a block: 4 when a KV head has at most 4 (decoding, GQA groups of up to 4),
// else 8 (trees); registers hold R x kDimsPerLane accumulators per lane.
constexpr int kAttnMaxRowsPerBlock = 8;
constexpr int kAttnThreads = 128;
constexpr int kAttnSlice = 32;  // head dimensions of K staged per step

// Largest supported head dim: dims_per_lane (a template parameter) is at most 16.
constexpr int64_t kAttnMaxHeadDim = 16 * kWarp;

JAKIRO_HOST_DEVICE size_t run_keys_smem_bytes(int rows_per_block) {
  return (sizeof(int32_t) + kFixedSplitMaxTree) * static_cast<size_t>(rows_per_block);
}

inline size_t tree_attention_smem_bytes(int64_t head_dim, int rows_per_block) {
  const int warps = kAttnThreads / kWarp;
  return sizeof(float) * (rows_per_block * head_dim                                // queries, then the merge
                          + warps * (kWarp * (kAttnSlice + 1) + rows_per_block * kWarp)  // K slice, P
                          + warps * rows_per_block * 2)                            // warp max and sum
         + run_keys_smem_bytes(rows_per_block);                                    // fixed splits: rows' tree keys
}

// Fixed splits: each row's visible tree keys in index order and their count (RunKeys::count[r],
// RunKeys::tree[r * kFixedSplitMaxTree + i]), filled by the block once; rows past the end see none.
struct RunKeys {
  int32_t* count;
  uint8_t* tree;  // tree indices < kFixedSplitMaxTree
  JAKIRO_HOST_DEVICE explicit RunKeys(void* smem, int rows_per_block)
      : count(static_cast<int32_t*>(smem)), tree(static_cast<uint8_t*>(smem) + sizeof(int32_t) * rows_per_block) {}
};
template <typename kv_t>
JAKIRO_DEVICE void gather_run_keys(const TreeAttentionParams<kv_t>& p, int64_t b, int64_t row0, int64_t rows,
                                   int rows_per_block, RunKeys run) {
  const int64_t group = p.q_heads / p.kv_heads;
  for (int r = threadIdx.x; r < rows_per_block; r += blockDim.x) {
    const int64_t row = row0 + r;
    int32_t n = 0;
    if (row < rows) {
      const int64_t* mask_row = p.tree_mask + (b * p.tree_len + row / group) * p.mask_stride;
      for (int64_t j = 0; j < p.tree_len; ++j)
        if (mask_bit(mask_row, j)) run.tree[r * kFixedSplitMaxTree + n++] = static_cast<uint8_t>(j);
    }
    run.count[r] = n;
  }
}

// The cache key at position `pos` (< the split's hi) of row r's run; -1 where the run has ended.
JAKIRO_DEVICE int64_t run_key(RunKeys run, int r, int64_t prefix, int64_t pos) {
  if (pos < prefix) return pos;
  const int64_t i = pos - prefix;
  return i < run.count[r] ? prefix + run.tree[r * kFixedSplitMaxTree + i] : -1;
}

// The keys [lo, hi) that split `split` of sequence b covers (its prefix, then its tree; with
// fixed splits, positions of the rows' runs, which end at or before hi), and the K/V rows of KV
// head kvh. A prefix length that leaves no room for the tree is reported and
// covers no key (the rows then see nothing: out 0, lse -inf).
template <typename kv_t>
struct SplitKeys {
  int64_t prefix, lo, hi;
  const kv_t* k;
  const kv_t* v;
};
template <typename kv_t>
JAKIRO_DEVICE SplitKeys<kv_t> split_keys(const TreeAttentionParams<kv_t>& p, int64_t b, int64_t kvh, int64_t split) {
  const int64_t offset = b * p.kv_batch_stride + kvh * p.kv_head_stride;
  const int64_t prefix = p.prefix_lens[b], length = prefix + p.tree_len;
  if (prefix < 0 || prefix > p.capacity - p.tree_len) {
    if (threadIdx.x == 0) report_error(p.errors, kBadPrefixLens);
    return {0, 0, 0, p.k_cache + offset, p.v_cache + offset};
  }
  const int64_t chunk = p.split_len > 0 ? p.split_len : ceil_div(length, p.splits);
  const int64_t lo = split * chunk < length ? split * chunk : length;
  const int64_t hi = (split + 1) * chunk < length ? (split + 1) * chunk : length;
  return {prefix, lo, hi, p.k_cache + offset, p.v_cache + offset};
}

// Fixed splits: a split past every run of its sequence is empty: the log-sum-exp of the block's
// query rows [row0, row0 + n) is -inf, and their outputs are left unwritten (the merge does not
// read an empty split's).
template <typename kv_t>
JAKIRO_DEVICE void write_empty_split(const TreeAttentionParams<kv_t>& p, int64_t b, int64_t kvh, int64_t split,
                                     int64_t row0, int64_t n) {
  const int64_t group = p.q_heads / p.kv_heads, rows = p.tree_len * group;
  for (int64_t row = row0 + threadIdx.x; row < rows && row < row0 + n; row += blockDim.x)
    p.lse_partial[((b * p.tree_len + row / group) * p.q_heads + kvh * group + row % group) * p.splits + split] =
        neg_inf();
}

template <typename kv_t, int R, int kDimsPerLane>
__global__ void __launch_bounds__(kAttnThreads) tree_attention_partial_kernel(TreeAttentionParams<kv_t> p) {
  const int64_t split = blockIdx.x;
  const int64_t b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const int64_t group = p.q_heads / p.kv_heads, D = p.head_dim;
  const int64_t rows = p.tree_len * group, row0 = (p.row_block0 + blockIdx.z) * R;
  const int warps = num_warps(), warp = warp_id(), lane = lane_id();

  JAKIRO_DYNAMIC_SMEM(float, smem);
  float* q_s = smem;                                   // [R][D], later the merged output
  float* k_s = q_s + R * D + warp * kWarp * (kAttnSlice + 1);  // this warp's [kWarp][kAttnSlice + 1]
  float* p_s = q_s + R * D + warps * kWarp * (kAttnSlice + 1) + warp * R * kWarp;  // [R][kWarp]
  float* max_s = q_s + R * D + warps * (kWarp * (kAttnSlice + 1) + R * kWarp);     // [warps][R]
  float* sum_s = max_s + warps * R;                                                 // [warps][R]
  const RunKeys run(sum_s + warps * R, R);
  const bool in_run_order = p.split_len > 0;

  const SplitKeys<kv_t> keys_of_split = split_keys(p, b, kvh, split);
  const int64_t prefix = keys_of_split.prefix, lo = keys_of_split.lo, hi = keys_of_split.hi;  // (plain: key_of captures them)
  const kv_t *k_base = keys_of_split.k, *v_base = keys_of_split.v;
  if (in_run_order && lo >= hi) return write_empty_split(p, b, kvh, split, row0, R);

  // Query row r of the block: tree token t = row / group, query head kvh * group + row % group.
  for (int64_t i = threadIdx.x; i < R * D; i += blockDim.x) {
    const int64_t r = i / D, row = row0 + r;
    float v = 0.f;
    if (row < rows) {
      const int64_t t = row / group, h = kvh * group + row % group;
      v = to_float(p.q[((b * p.tree_len + t) * p.q_heads + h) * D + i % D]) * p.scale;
    }
    q_s[i] = v;
  }
  if (in_run_order) gather_run_keys(p, b, row0, rows, R, run);
  __syncthreads();

  // Row r's key at position pos (< hi) of the split: in place, or (fixed splits) of its run; -1: unseen.
  auto key_of = [&](int r, int64_t pos) -> int64_t {
    const int64_t row = row0 + r;
    if (row >= rows) return -1;
    if (in_run_order) return run_key(run, r, prefix, pos);
    return pos < prefix || mask_bit(p.tree_mask + (b * p.tree_len + row / group) * p.mask_stride, pos - prefix)
               ? pos
               : -1;
  };

  OnlineSoftmax state[R];
  float acc[R][kDimsPerLane];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kDimsPerLane; ++i) acc[r][i] = 0.f;

  for (int64_t key0 = lo + warp * kWarp; key0 < hi; key0 += warps * kWarp) {  // warp-uniform loop
    const int64_t pos = key0 + lane;
    // Every row reads the same keys (in place, or a run's chunk within the prefix), or each its own.
    const bool shared = !in_run_order || key0 + kWarp <= prefix;
    float score[R];
    for (int r = 0; r < R; ++r) score[r] = 0.f;
    for (int64_t d0 = 0; d0 < D; d0 += kAttnSlice) {
      const int64_t width = D - d0 < kAttnSlice ? D - d0 : kAttnSlice;
      for (int r = 0; r < R; ++r) {
        if (r == 0 || (!shared && (row0 + r) / group != (row0 + r - 1) / group)) {
          // Stage row r's keys at positions key0 .. key0 + kWarp, dims d0 .. d0 + kAttnSlice (zeros
          // past the ends and for keys no row sees here: a shared chunk stages every position; a
          // token's query heads share its keys).
          warp_sync();
          for (int e = lane; e < kWarp * kAttnSlice; e += kWarp) {
            const int kk = e / kAttnSlice, dd = e % kAttnSlice;
            const int64_t pos_e = key0 + kk, d = d0 + dd;
            const int64_t key = pos_e >= hi ? -1 : shared ? pos_e : key_of(r, pos_e);
            k_s[kk * (kAttnSlice + 1) + dd] = (key >= 0 && d < D) ? to_float(k_base[key * D + d]) : 0.f;
          }
          warp_sync();
        }
        const float* qr = q_s + r * D + d0;
        float s = 0.f;
        for (int64_t dd = 0; dd < width; ++dd) s += qr[dd] * k_s[lane * (kAttnSlice + 1) + dd];
        score[r] += s;
      }
    }
    warp_sync();
    // Mask: what a row does not see (past hi, past its run, or a tree key off its mask row) is -inf.
    for (int r = 0; r < R; ++r)
      if (pos >= hi || key_of(r, pos) < 0) score[r] = neg_inf();
    // Online softmax per row; this lane's probability goes to p_s for the P @ V product.
    float factor[R];
    for (int r = 0; r < R; ++r) {
      if (warp_max(poisons(score[r]) ? 1.f : 0.f) > 0.f) {  // a NaN or +inf score: the row is NaN
        state[r].poison();
        factor[r] = 1.f;
        p_s[r * kWarp + lane] = 0.f;
        continue;  // warp-uniform
      }
      const float block_max = warp_max(score[r]);
      factor[r] = state[r].rescale_for(block_max);
      const float prob = score[r] == neg_inf() ? 0.f : expf(score[r] - state[r].max);
      state[r].sum += warp_sum(prob);
      p_s[r * kWarp + lane] = prob;
    }
    warp_sync();
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kDimsPerLane; ++i) acc[r][i] *= factor[r];
    const int64_t keys = hi - key0 < kWarp ? hi - key0 : kWarp;
    for (int64_t j = 0; j < keys; ++j) {
      // A row reads the values it attends to only: a NaN in a tree node's value it does not
      // see must not reach it (0 * NaN is NaN).
      int64_t key[R];
      for (int r = 0; r < R; ++r) key[r] = key_of(r, key0 + j);
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int64_t d = lane + i * kWarp;
        const float v_shared = shared && d < D ? to_float(v_base[(key0 + j) * D + d]) : 0.f;  // one read, every row
        for (int r = 0; r < R; ++r) {
          if (key[r] < 0) continue;
          const float v = shared ? v_shared : d < D ? to_float(v_base[key[r] * D + d]) : 0.f;
          acc[r][i] += p_s[r * kWarp + j] * v;
        }
      }
    }
    warp_sync();
  }

  // Merge the warps: the block's max per row, then each warp adds its rescaled sum and values.
  if (lane == 0) {
    for (int r = 0; r < R; ++r) {
      max_s[warp * R + r] = state[r].max;
      sum_s[warp * R + r] = state[r].sum;
    }
  }
  __syncthreads();  // also: every warp is done with q_s, which now collects the output
  float weight[R];
  for (int r = 0; r < R; ++r) {
    float m = neg_inf();
    for (int w = 0; w < warps; ++w) m = fmaxf(m, max_s[w * R + r]);
    weight[r] = merge_weight(state[r].sum > 0.f ? state[r].max : neg_inf(), m);
  }
  for (int w = 0; w < warps; ++w) {
    if (warp == w) {
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < kDimsPerLane; ++i) {
          const int64_t d = lane + i * kWarp;
          if (d < D) q_s[r * D + d] = (w == 0 ? 0.f : q_s[r * D + d]) + weight[r] * acc[r][i];
        }
    }
    __syncthreads();
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + r;
    if (row >= rows) continue;
    float m = neg_inf();
    bool poisoned = false;  // some warp saw a NaN or +inf score
    for (int w = 0; w < warps; ++w) {
      m = fmaxf(m, max_s[w * R + r]);
      poisoned |= sum_s[w * R + r] != sum_s[w * R + r];
    }
    float total = 0.f;
    for (int w = 0; w < warps; ++w)
      total += sum_s[w * R + r] > 0.f ? sum_s[w * R + r] * merge_weight(max_s[w * R + r], m) : 0.f;
    const int64_t t = row / group, h = kvh * group + row % group;
    const int64_t out_row = ((b * p.tree_len + t) * p.q_heads + h) * p.splits + split;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      p.out_partial[out_row * D + d] = poisoned ? quiet_nan() : total > 0.f ? q_s[r * D + d] / total : 0.f;
    if (threadIdx.x == 0) p.lse_partial[out_row] = poisoned ? quiet_nan() : total > 0.f ? m + logf(total) : neg_inf();
  }
}

template <typename kv_t, int R, int kDimsPerLane>
void launch_tree_attention_partial_with(const TreeAttentionParams<kv_t>& p, cudaStream_t stream) {
  const int64_t blocks = ceil_div(p.tree_len * (p.q_heads / p.kv_heads), R);
  for (int64_t z0 = 0; z0 < blocks; z0 += kMaxGridYZ) {
    TreeAttentionParams<kv_t> part = p;
    part.row_block0 = z0;
    const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.batch * p.kv_heads),
                    static_cast<unsigned>(blocks - z0 < kMaxGridYZ ? blocks - z0 : kMaxGridYZ));
    JAKIRO_LAUNCH(grid, kAttnThreads, tree_attention_smem_bytes(p.head_dim, R), stream,
                  tree_attention_partial_kernel<kv_t, R, kDimsPerLane>)(part);
  }
}

template <typename kv_t, int R>
void launch_tree_attention_partial_rows(const TreeAttentionParams<kv_t>& p, cudaStream_t stream) {
  const int64_t dims_per_lane = ceil_div(p.head_dim, kWarp);
  if (dims_per_lane <= 1) return launch_tree_attention_partial_with<kv_t, R, 1>(p, stream);
  if (dims_per_lane <= 2) return launch_tree_attention_partial_with<kv_t, R, 2>(p, stream);
  if (dims_per_lane <= 4) return launch_tree_attention_partial_with<kv_t, R, 4>(p, stream);
  if (dims_per_lane <= 8) return launch_tree_attention_partial_with<kv_t, R, 8>(p, stream);
  return launch_tree_attention_partial_with<kv_t, R, 16>(p, stream);
}

// Requires head_dim <= kAttnMaxHeadDim (the glue checks it).
template <typename kv_t>
void launch_tree_attention_partial(const TreeAttentionParams<kv_t>& p, cudaStream_t stream) {
  if (p.batch == 0 || p.splits == 0 || p.q_heads == 0) return;  // no block to launch
  if (p.tree_len * (p.q_heads / p.kv_heads) <= 4) return launch_tree_attention_partial_rows<kv_t, 4>(p, stream);
  launch_tree_attention_partial_rows<kv_t, kAttnMaxRowsPerBlock>(p, stream);
}

}  // namespace jakiro::gpu
