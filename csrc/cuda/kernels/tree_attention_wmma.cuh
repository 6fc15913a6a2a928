// Tensor-core split-KV tree attention (bf16 in, float accumulation) through the WMMA API: the
// same contract as tree_attention.cuh's CUDA-core kernel (partial output and log-sum-exp per
// split, merged by merge_attention_states.cuh), for trees whose query rows per KV head
// (tree tokens x GQA group) fill 16-row tiles.
//
// Grid: (split, batch x KV head, chunk of 64 query rows). Each of the block's 4 warps owns 16
// query rows (a WMMA tile); the block stages 16 keys of K and V at a time in shared memory, which
// every warp reads (each K/V load serves all 64 rows). Per key chunk a warp computes
//   S = Q K^T (16 x 16, float)     by D/16 mma_sync over the head dimension,
//   the online softmax of its rows  (lane r < 16 takes row r: mask, poison, rescale factor; the
//                                    sum, hence the log-sum-exp, in float),
//   O = O * factor + P V            (P rounded to bf16; O in D/16 float accumulator fragments).
// The accumulators are rescaled element-wise through a fragment of row indices (an accumulator
// loaded from a matrix whose entry (r, c) is r): the element-to-lane layout stays hidden.
// Non-finite values keep the CUDA-core kernel's semantics: a NaN or +inf score poisons its row;
// a value row is read only by the rows that see its key (a non-finite value is staged as 0 and
// its products are added element-wise for the rows that see it, as 0 * NaN must not reach the
// others).
//
// Fixed splits (TreeAttentionParams::split_len > 0; tree_attention.cuh) keep a row's bits those of
// its one-token step, which this kernel runs too (the glue sends a decoding step here when a tree
// would come here): a row's run (the prefix, then its visible tree keys in index order) is cut at
// near(row) = the run's length less kFixedSplitMaxTree, rounded down to 16 (at most the prefix,
// and a function of the run's length alone). Positions before it are prefix keys, the same for
// every row: the tiles above sum them (a row's tile elements depend on that row and key alone).
// Positions from it on (at most 79, the row's ancestors among them) are the "near run": each
// row's keys gathered, scores and P V summed in float element by element, 16 positions at a time.
#pragma once

#include "cuda/device.h"
#include "cuda/kernels/tree_attention.cuh"
#include "cuda/wmma.h"

#if defined(JAKIRO_HAS_WMMA)

namespace jakiro::gpu {

constexpr int kTcWarps = 4;                    // warps (row tiles) per block
constexpr int kTcRows = kTcTile * kTcWarps;    // query rows per block
constexpr int64_t kTcMaxHeadDim = 128;         // accumulators: D / 16 fragments per warp

// The tensor-core kernel serves bf16 heads of a multiple of 16 up to 128 dims: with fixed splits
// every row count (one-token steps and trees alike), otherwise rows per KV head that fill at least
// one 16-row tile.
inline bool tree_attention_uses_tensor_cores(bool bf16, int64_t head_dim, int64_t rows_per_kv_head,
                                             bool fixed_splits) {
  return bf16 && head_dim % kTcTile == 0 && head_dim <= kTcMaxHeadDim && (fixed_splits || rows_per_kv_head >= kTcTile);
}

struct TcSmemLayout {  // byte offsets into the dynamic shared memory
  size_t q, k, v, s, p, row_id, col_id, state, flag, run, near_key, total;
  JAKIRO_HOST_DEVICE explicit TcSmemLayout(int64_t head_dim) {
    const size_t ld = static_cast<size_t>(head_dim) + kTcPad;
    q = 0;                                                                 // bf16 [kTcRows][ld]
    k = q + sizeof(__nv_bfloat16) * kTcRows * ld;                          // bf16 [16][ld]
    v = k + sizeof(__nv_bfloat16) * kTcTile * ld;                          // bf16 [16][ld]
    s = v + sizeof(__nv_bfloat16) * kTcTile * ld;                          // float [warps][16][16]
    p = s + sizeof(float) * kTcWarps * kTcTile * kTcTile;                  // bf16 [warps][16][16 + pad]
    row_id = p + sizeof(__nv_bfloat16) * kTcWarps * kTcTile * (kTcTile + kTcPad);  // float [16][16]
    col_id = row_id + sizeof(float) * kTcTile * kTcTile;                   // float [16][16]
    state = col_id + sizeof(float) * kTcTile * kTcTile;                    // float [warps][16]: factor, then 1/sum
    flag = state + sizeof(float) * kTcWarps * kTcTile;                     // int [2]: a non-finite value in the chunk
    run = flag + 16;                                                       // fixed splits: RunKeys of the block's rows
    near_key = (run + run_keys_smem_bytes(kTcRows) + 15) / 16 * 16;       // int32 [kTcRows][16]: a near chunk's keys
    total = near_key + sizeof(int32_t) * kTcRows * kTcTile;
  }
};

// a . b over D dims (a multiple of 8) in dimension order, in float: 16-byte loads where both rows
// are 16-byte aligned, else one element at a time (the same sums either way).
JAKIRO_DEVICE float dot_in_order(const bf16* a, const bf16* b, int64_t D) {
  float dot = 0.f;
  if (aligned16(a) && aligned16(b)) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      float x[8], y[8];
      unpack_to(load16(a + d0), x, 0, a);
      unpack_to(load16(b + d0), y, 0, b);
      JAKIRO_UNROLL
      for (int e = 0; e < 8; ++e) dot += x[e] * y[e];
    }
  } else {
    for (int64_t d = 0; d < D; ++d) dot += to_float(a[d]) * to_float(b[d]);
  }
  return dot;
}

template <int kDims>  // head_dim / 16
__global__ void __launch_bounds__(kTcWarps * kWarp)
    tree_attention_partial_wmma_kernel(TreeAttentionParams<bf16> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  return;  // bf16 WMMA needs sm_80; the glue never launches this kernel on older devices
#else
  constexpr int D = kDims * kTcTile, ld = D + kTcPad, ldp = kTcTile + kTcPad;
  const int64_t split = blockIdx.x;
  const int64_t b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const int64_t group = p.q_heads / p.kv_heads, rows = p.tree_len * group;
  const int warp = warp_id(), lane = lane_id();
  const int64_t block_row0 = (p.row_block0 + blockIdx.z) * kTcRows, row0 = block_row0 + warp * kTcTile;

  JAKIRO_DYNAMIC_SMEM(unsigned char, smem);
  const TcSmemLayout L(D);
  auto* q_s = reinterpret_cast<bf16*>(smem + L.q);
  auto* k_s = reinterpret_cast<bf16*>(smem + L.k);
  auto* v_s = reinterpret_cast<bf16*>(smem + L.v);
  float* s_w = reinterpret_cast<float*>(smem + L.s) + warp * kTcTile * kTcTile;
  bf16* p_w = reinterpret_cast<bf16*>(smem + L.p) + warp * kTcTile * ldp;
  float* row_id_s = reinterpret_cast<float*>(smem + L.row_id);
  float* col_id_s = reinterpret_cast<float*>(smem + L.col_id);
  float* state_w = reinterpret_cast<float*>(smem + L.state) + warp * kTcTile;
  int* nonfinite_flags = reinterpret_cast<int*>(smem + L.flag);  // by chunk parity: reset while the next is staged

  const bool in_run_order = p.split_len > 0;
  const SplitKeys<bf16> keys = split_keys(p, b, kvh, split);
  const int64_t prefix = keys.prefix, lo = keys.lo, hi = keys.hi;  // (plain variables: lambdas capture them)
  const bf16 *k_base = keys.k, *v_base = keys.v;
  if (in_run_order && lo >= hi) return write_empty_split(p, b, kvh, split, block_row0, kTcRows);
  const RunKeys run(smem + L.run, kTcRows);

  // Query row r of the block: tree token t = row / group, query head kvh * group + row % group
  // (unscaled: the scale is applied to the float scores). Rows past the end are zeros.
  for (int64_t i = threadIdx.x; i < kTcRows * D; i += blockDim.x) {
    const int64_t r = i / D, d = i % D, row = block_row0 + r;
    bf16 v{0};
    if (row < rows) v = p.q[((b * p.tree_len + row / group) * p.q_heads + kvh * group + row % group) * D + d];
    q_s[r * ld + d] = v;
  }
  for (int i = threadIdx.x; i < kTcTile * kTcTile; i += blockDim.x) {
    row_id_s[i] = static_cast<float>(i / kTcTile);
    col_id_s[i] = static_cast<float>(i % kTcTile);
  }
  if (threadIdx.x == 0) nonfinite_flags[0] = nonfinite_flags[1] = 0;
  if (in_run_order) gather_run_keys(p, b, block_row0, rows, kTcRows, run);
  __syncthreads();

  TcFragC row_of, col_of, acc[kDims];
  wmma::load_matrix_sync(row_of, row_id_s, kTcTile, wmma::mem_row_major);
  wmma::load_matrix_sync(col_of, col_id_s, kTcTile, wmma::mem_row_major);
  for (int n = 0; n < kDims; ++n) wmma::fill_fragment(acc[n], 0.f);
  TcFragA q_frag[kDims];
  for (int k = 0; k < kDims; ++k) wmma::load_matrix_sync(q_frag[k], tc_ptr(q_s + warp * kTcTile * ld + k * kTcTile), ld);

  // Does query row `row` (< rows) see key `key` (< hi)? (Even parts: the tree keys in place.)
  auto sees = [&](int64_t row, int64_t key) {
    return key < prefix || mask_bit(p.tree_mask + (b * p.tree_len + row / group) * p.mask_stride, key - prefix);
  };
  // Fixed splits: block row r's run length and where its near run starts (module comment).
  auto run_len = [&](int64_t r) { return prefix + run.count[r]; };
  auto near_start = [&](int64_t r) {
    const int64_t far = run_len(r) - kFixedSplitMaxTree;
    return far > 0 ? far / kTcTile * kTcTile : int64_t{0};
  };
  // Does block row r see position pos of the split through the tiles (the far keys)?
  auto far_sees = [&](int64_t r, int64_t pos) {
    return in_run_order ? pos < near_start(r) : sees(block_row0 + r, pos);
  };
  int64_t far_hi = hi, near_lo = hi, near_hi = hi;  // fixed splits: the block's far keys end, its near runs' span
  if (in_run_order) {
    int64_t most_far = 0, least_near = hi, longest = 0;
    for (int64_t r = 0; r < kTcRows && block_row0 + r < rows; ++r) {
      most_far = near_start(r) > most_far ? near_start(r) : most_far;
      least_near = near_start(r) < least_near ? near_start(r) : least_near;
      longest = run_len(r) > longest ? run_len(r) : longest;
    }
    far_hi = most_far < hi ? most_far : hi;
    near_lo = least_near > lo ? least_near : lo;
    near_hi = longest < hi ? longest : hi;
  }

  OnlineSoftmax state;  // lane r < 16: the state of row row0 + r
  const int64_t my_row = row0 + lane;
  const bool owns_row = lane < kTcTile && my_row < rows;
  const bool warp_has_rows = row0 < rows;  // a warp of padding rows only stages

  // Lane r's online softmax over a chunk of its row's 16 scores (-inf: not seen): replaces them
  // by their probabilities (0 once poisoned by a NaN or +inf score) and returns the factor that
  // rescales what the row accumulated; the sum (hence the log-sum-exp) stays in float.
  auto fold = [&](float (&sc)[kTcTile]) {
    float chunk_max = neg_inf();
    bool poisoned = false;
    for (int j = 0; j < kTcTile; ++j) {
      poisoned |= poisons(sc[j]);
      chunk_max = fmaxf(chunk_max, sc[j]);
    }
    if (poisoned || state.poisoned()) {
      state.poison();
      for (int j = 0; j < kTcTile; ++j) sc[j] = 0.f;
      return 1.f;
    }
    const float factor = state.rescale_for(chunk_max);
    for (int j = 0; j < kTcTile; ++j) {
      sc[j] = sc[j] == neg_inf() ? 0.f : expf(sc[j] - state.max);
      state.sum += sc[j];
    }
    return factor;
  };

  for (int64_t key0 = lo, chunk_index = 0; key0 < far_hi; key0 += kTcTile, ++chunk_index) {  // block-uniform loop
    int* nonfinite_s = nonfinite_flags + (chunk_index & 1);
    // Stage 16 keys of K and V (zeros past far_hi); a non-finite value is staged as 0 and flagged.
    for (int64_t i = threadIdx.x; i < kTcTile * D; i += blockDim.x) {
      const int64_t j = i / D, d = i % D, key = key0 + j;
      bf16 kv{0}, vv{0};
      if (key < far_hi) {
        kv = k_base[key * D + d];
        vv = v_base[key * D + d];
        if (!(fabsf(to_float(vv)) < INFINITY)) {
          vv = bf16{0};
          atomicMax(nonfinite_s, 1);
        }
      }
      k_s[j * ld + d] = kv;
      v_s[j * ld + d] = vv;
    }
    __syncthreads();

    if (warp_has_rows) {
      // S = Q K^T for this warp's 16 rows and the chunk's 16 keys.
      TcFragC score;
      wmma::fill_fragment(score, 0.f);
      for (int k = 0; k < kDims; ++k) {
        TcFragBCol k_frag;  // K^T: element (dim, key) at k_s[key * ld + dim]
        wmma::load_matrix_sync(k_frag, tc_ptr(k_s + k * kTcTile), ld);
        wmma::mma_sync(score, q_frag[k], k_frag, score);
      }
      wmma::store_matrix_sync(s_w, score, kTcTile, wmma::mem_row_major);
      warp_sync();

      // Online softmax: lane r takes row r (mask, poison, running max and sum); P to shared memory.
      if (lane < kTcTile) {
        float sc[kTcTile];
        for (int j = 0; j < kTcTile; ++j) {
          const int64_t key = key0 + j;
          sc[j] = owns_row && key < far_hi && far_sees(my_row - block_row0, key) ? s_w[lane * kTcTile + j] * p.scale
                                                                                : neg_inf();
        }
        state_w[lane] = fold(sc);
        for (int j = 0; j < kTcTile; ++j) p_w[lane * ldp + j] = from_float<bf16>(sc[j]);  // the product rounds P to bf16
      }
      warp_sync();

      // O = O * factor + P V.
      TcFragA p_frag;
      wmma::load_matrix_sync(p_frag, tc_ptr(p_w), ldp);
      for (int n = 0; n < kDims; ++n) {
        for (int i = 0; i < acc[n].num_elements; ++i) acc[n].x[i] *= state_w[static_cast<int>(row_of.x[i])];
        TcFragBRow v_frag;  // V: element (key, dim) at v_s[key * ld + dim]
        wmma::load_matrix_sync(v_frag, tc_ptr(v_s + n * kTcTile), ld);
        wmma::mma_sync(acc[n], p_frag, v_frag, acc[n]);
      }
      if (*nonfinite_s) {  // rare: add p * v of the non-finite values for the rows that see them
        for (int n = 0; n < kDims; ++n)
          for (int i = 0; i < acc[n].num_elements; ++i) {
            const int r = static_cast<int>(row_of.x[i]);
            const int64_t row = row0 + r, d = n * kTcTile + static_cast<int>(col_of.x[i]);
            if (row >= rows) continue;
            for (int j = 0; j < kTcTile && key0 + j < far_hi; ++j) {
              const float v = to_float(v_base[(key0 + j) * D + d]);
              if (!(fabsf(v) < INFINITY) && far_sees(row - block_row0, key0 + j)) acc[n].x[i] += to_float(p_w[r * ldp + j]) * v;
            }
          }
      }
    }
    __syncthreads();  // every warp is done with this chunk's K, V and flag
    if (threadIdx.x == 0) *nonfinite_s = 0;  // for the chunk after next
  }

  // Fixed splits: the near runs, 16 positions at a time, in float (module comment). Block row r's
  // position pos is in its near run when near_start(r) <= pos < run_len(r) (and within the split).
  auto in_near_run = [&](int64_t r, int64_t pos) {
    return block_row0 + r < rows && pos >= near_start(r) && pos < run_len(r) && pos >= lo && pos < hi;
  };
  int32_t* near_key_s = reinterpret_cast<int32_t*>(smem + L.near_key);  // [kTcRows][16]: -1 where not in the run
  for (int64_t pos0 = near_lo; pos0 < near_hi; pos0 += kTcTile) {  // block-uniform loop (none for even parts)
    // Each (row, position) pair of the chunk: its key, and its score q . k in dimension order,
    // into the key table and each warp's s_w (block row r: warp r / 16's row r % 16).
    for (int64_t e = threadIdx.x; e < kTcRows * kTcTile; e += blockDim.x) {
      const int64_t r = e / kTcTile, pos = pos0 + e % kTcTile;
      const int64_t key = in_near_run(r, pos) ? run_key(run, static_cast<int>(r), prefix, pos) : -1;
      near_key_s[e] = static_cast<int32_t>(key);
      reinterpret_cast<float*>(smem + L.s)[e] = key < 0 ? neg_inf() : dot_in_order(q_s + r * ld, k_base + key * D, D) * p.scale;
    }
    __syncthreads();
    if (warp_has_rows) {
      if (lane < kTcTile) {
        float sc[kTcTile];
        for (int j = 0; j < kTcTile; ++j) sc[j] = s_w[lane * kTcTile + j];
        state_w[lane] = fold(sc);
        for (int j = 0; j < kTcTile; ++j) s_w[lane * kTcTile + j] = sc[j];
      }
      warp_sync();
      // O = O * factor + P V, element by element over the row's own values, in position order.
      const int32_t* keys_w = near_key_s + warp * kTcTile * kTcTile;
      for (int n = 0; n < kDims; ++n)
        for (int i = 0; i < acc[n].num_elements; ++i) {
          const int r = static_cast<int>(row_of.x[i]);
          const int64_t d = n * kTcTile + static_cast<int>(col_of.x[i]);
          float o = acc[n].x[i] * state_w[r];
          for (int j = 0; j < kTcTile; ++j) {
            const int64_t key = keys_w[r * kTcTile + j];
            if (key >= 0) o += s_w[r * kTcTile + j] * to_float(v_base[key * D + d]);
          }
          acc[n].x[i] = o;
        }
    }
    __syncthreads();  // every warp is done with its s_w before the next chunk's scores
  }

  // Normalise and write: lane r publishes row r's 1 / sum (NaN when poisoned, 0 when empty).
  if (lane < kTcTile) {
    state_w[lane] = state.poisoned() ? quiet_nan() : state.sum > 0.f ? 1.f / state.sum : 0.f;
    if (owns_row) {
      const int64_t t = my_row / group, h = kvh * group + my_row % group;
      p.lse_partial[((b * p.tree_len + t) * p.q_heads + h) * p.splits + split] =
          state.poisoned() ? quiet_nan() : state.sum > 0.f ? state.max + logf(state.sum) : neg_inf();
    }
  }
  for (int n = 0; n < kDims; ++n) {
    warp_sync();  // state_w written; s_w free again
    wmma::store_matrix_sync(s_w, acc[n], kTcTile, wmma::mem_row_major);
    warp_sync();
    for (int e = lane; e < kTcTile * kTcTile; e += kWarp) {
      const int r = e / kTcTile;
      const int64_t row = row0 + r;
      if (row >= rows) continue;
      const int64_t out_row = ((b * p.tree_len + row / group) * p.q_heads + kvh * group + row % group) * p.splits + split;
      const float inv = state_w[r];
      p.out_partial[out_row * D + n * kTcTile + e % kTcTile] = inv != inv ? quiet_nan() : s_w[e] * inv;
    }
  }
#endif
}

template <int kDims>
void launch_tree_attention_partial_wmma_with(const TreeAttentionParams<bf16>& p, cudaStream_t stream) {
  const int64_t blocks = ceil_div(p.tree_len * (p.q_heads / p.kv_heads), kTcRows);
  const size_t smem = TcSmemLayout(kDims * kTcTile).total;  // <= 44 KB at 128 dims: no opt-in beyond 48 KB
  for (int64_t z0 = 0; z0 < blocks; z0 += kMaxGridYZ) {
    TreeAttentionParams<bf16> part = p;
    part.row_block0 = z0;
    const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.batch * p.kv_heads),
                    static_cast<unsigned>(blocks - z0 < kMaxGridYZ ? blocks - z0 : kMaxGridYZ));
    JAKIRO_LAUNCH(grid, kTcWarps * kWarp, smem, stream, tree_attention_partial_wmma_kernel<kDims>)(part);
  }
}

// Requires tree_attention_uses_tensor_cores(...) and a device with bf16 WMMA (sm_80+).
inline void launch_tree_attention_partial_wmma(const TreeAttentionParams<bf16>& p, cudaStream_t stream) {
  if (p.batch == 0 || p.splits == 0 || p.q_heads == 0) return;
  switch (p.head_dim / kTcTile) {
    case 1: return launch_tree_attention_partial_wmma_with<1>(p, stream);
    case 2: return launch_tree_attention_partial_wmma_with<2>(p, stream);
    case 3: return launch_tree_attention_partial_wmma_with<3>(p, stream);
    case 4: return launch_tree_attention_partial_wmma_with<4>(p, stream);
    case 5: return launch_tree_attention_partial_wmma_with<5>(p, stream);
    case 6: return launch_tree_attention_partial_wmma_with<6>(p, stream);
    case 7: return launch_tree_attention_partial_wmma_with<7>(p, stream);
    default: return launch_tree_attention_partial_wmma_with<8>(p, stream);
  }
}

}  // namespace jakiro::gpu
#endif  // JAKIRO_HAS_WMMA
