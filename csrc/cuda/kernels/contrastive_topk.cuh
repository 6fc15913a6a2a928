// GPU kernels of the fused (contrastive) LM head: feature -> logits over the vocabulary ->
// log-softmax -> top-k (the CPU kernel: cpu/contrastive_topk.cpp).
//
// Three kernels per chunk of feature rows:
//   1. features: f = h_a, or w_hi * h_a - w_lo * h_b, in float32 [rows, H];
//   2. logits = f @ lm_head^T into a float32 scratch [chunk rows, V], weight-stationary: a
//      block owns a tile of vocabulary rows, each warp reads a few LM-head rows (lanes split
//      H) and uses them for every feature row before the next (the op is bound by reading the
//      LM head at decoding sizes: it is read once, in its own dtype);
//   3. log-sum-exp (block max, block sum), the top-k by the block selection
//      (kernels/block_topk.cuh), logprobs = logit - lse: one block per feature row; or, for
//      k <= kSplitMaxK and long rows, split: a block per (row, vocabulary slice) finds the
//      slice's max, sum and top-k, then a block per row merges them (a lone block on a long
//      row is bound by its own instruction issue).
#pragma once

#include "cuda/device.h"
#include "cuda/kernels/block_topk.cuh"

namespace jakiro::gpu {

struct ContrastiveParams {
  const void* h_a;            // [rows, H], scalar_t
  const void* h_b;            // [rows, H], scalar_t, or null (plain feature)
  const float* weights;       // [rows, 2] float32 (w_hi, w_lo), null iff h_b is
  const void* lm_head;        // [V, H], scalar_t
  float* features;            // scratch [rows, H]
  float* logits;              // scratch [scratch_rows, V]
  float* logprobs;            // [rows, k]
  int64_t* token_ids;         // [rows, k]
  int64_t rows, hidden, vocab, k;
  int64_t scratch_rows;       // feature rows per chunk (>= 1): the logits scratch holds one chunk
  int64_t splits;             // vocabulary slices per row (1: no split, split_* unused)
  float* split_values;        // scratch [scratch_rows, splits, k]: each slice's top-k logits
  int64_t* split_indices;     // scratch [scratch_rows, splits, k]: their token ids
  float* split_max;           // scratch [scratch_rows, splits]
  float* split_sum;           // scratch [scratch_rows, splits]: sum of exp(logit - slice max)
};

namespace contrastive {
constexpr int kThreads = 256;
constexpr int kWideThreads = 1024;  // row top-k blocks for vocabularies of kWideVocab and more
constexpr int64_t kWideVocab = 8192;
constexpr int kVocabTile = 64;  // LM-head rows per block of the logits kernel
constexpr int kVocabPerWarp = 4;  // LM-head rows a warp reads at once
constexpr int kRowTile = 8;     // feature rows accumulated at once per LM-head row
constexpr int kTopK = 16;       // selection round size (k <= 16: one round)
constexpr int64_t kSplitLen = 2048;  // vocabulary slice per block of the split top-k
constexpr int64_t kSplitMaxK = 64;   // the split top-k for k up to this

// Vocabulary slices per row for the split top-k (1: one block per row).
inline int64_t split_count(int64_t vocab, int64_t k) {
  return k <= kSplitMaxK && vocab >= 2 * kSplitLen ? (vocab + kSplitLen - 1) / kSplitLen : 1;
}
}  // namespace contrastive

template <typename scalar_t>
__global__ void contrastive_features_kernel(ContrastiveParams p) {
  const int64_t n = p.rows * p.hidden;
  const scalar_t* a = static_cast<const scalar_t*>(p.h_a);
  const scalar_t* b = static_cast<const scalar_t*>(p.h_b);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float f = to_float(a[e]);
    if (b != nullptr) {
      const int64_t r = e / p.hidden;
      f = p.weights[2 * r] * f - p.weights[2 * r + 1] * to_float(b[e]);
    }
    p.features[e] = f;
  }
}

// Logits of feature rows [row0, row0 + nrows) into p.logits (row r at (r - row0) * V). A warp
// takes kVocabPerWarp LM-head rows at a time and a tile of kRowTile feature rows: per step
// along H each lane loads PACK weights of each LM-head row (16 bytes when PACK > 1) and PACK
// features of each feature row for kVocabPerWarp x kRowTile x PACK FMAs; then warp sums.
template <typename scalar_t, int PACK>
__global__ void contrastive_logits_kernel(ContrastiveParams p, int64_t row0, int64_t nrows) {
  using namespace contrastive;
  static_assert(PACK == 1 || PACK * sizeof(scalar_t) == sizeof(Pack16), "PACK: one element or 16 bytes");
  const int64_t H = p.hidden, V = p.vocab;
  const scalar_t* lm_head = static_cast<const scalar_t*>(p.lm_head);
  const int lane = lane_id();
  const int64_t v_begin = static_cast<int64_t>(blockIdx.x) * kVocabTile;
  const int64_t v_end = v_begin + kVocabTile < V ? v_begin + kVocabTile : V;
  for (int64_t v0 = v_begin + warp_id() * kVocabPerWarp; v0 < v_end; v0 += num_warps() * kVocabPerWarp) {
    const int nv = static_cast<int>(v_end - v0 < kVocabPerWarp ? v_end - v0 : kVocabPerWarp);  // warp-uniform
    const scalar_t* w = lm_head + v0 * H;
    // The LM-head rows come from memory for the first row tile, from cache after.
    for (int64_t r0 = 0; r0 < nrows; r0 += kRowTile) {
      const int nr = static_cast<int>(nrows - r0 < kRowTile ? nrows - r0 : kRowTile);  // warp-uniform
      const float* f = p.features + (row0 + r0) * H;
      float acc[kVocabPerWarp][kRowTile];
#pragma unroll
      for (int j = 0; j < kVocabPerWarp; ++j) {
#pragma unroll
        for (int r = 0; r < kRowTile; ++r) acc[j][r] = 0.f;
      }
      for (int64_t h = static_cast<int64_t>(lane) * PACK; h < H; h += kWarp * PACK) {
        float x[kVocabPerWarp][PACK];
#pragma unroll
        for (int j = 0; j < kVocabPerWarp; ++j) {
          scalar_t e[PACK];
          if (j >= nv) {
#pragma unroll
            for (int q = 0; q < PACK; ++q) e[q] = from_float<scalar_t>(0.f);
          } else if constexpr (PACK == 1) {
            e[0] = w[j * H + h];
          } else {
            const Pack16 pk = *reinterpret_cast<const Pack16*>(w + j * H + h);
            memcpy(e, &pk, sizeof pk);
          }
#pragma unroll
          for (int q = 0; q < PACK; ++q) x[j][q] = to_float(e[q]);
        }
#pragma unroll
        for (int r = 0; r < kRowTile; ++r) {
          if (r < nr) {
            float fr[PACK];
            if constexpr (PACK == 1) {
              fr[0] = f[r * H + h];
            } else {
#pragma unroll
              for (int q = 0; q < PACK; q += 4) {
                const Pack16 pk = *reinterpret_cast<const Pack16*>(f + r * H + h + q);
                memcpy(fr + q, &pk, sizeof pk);
              }
            }
#pragma unroll
            for (int q = 0; q < PACK; ++q) {
#pragma unroll
              for (int j = 0; j < kVocabPerWarp; ++j) acc[j][r] += fr[q] * x[j][q];
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kVocabPerWarp; ++j) {
#pragma unroll
        for (int r = 0; r < kRowTile; ++r) {
          if (j < nv && r < nr) {
            const float s = warp_sum(acc[j][r]);
            if (lane == 0) p.logits[(r0 + r) * V + v0 + j] = s;
          }
        }
      }
    }
  }
}

// A row without a distribution (a NaN or +inf logit, or every logit -inf): NaN log-probabilities
// and token -1, as the CPU kernel gives.
JAKIRO_DEVICE void write_no_distribution(float* out_lp, int64_t* out_id, int64_t k) {
  for (int64_t rank = threadIdx.x; rank < k; rank += blockDim.x) {
    out_lp[rank] = quiet_nan();
    out_id[rank] = -1;
  }
}

// One block per feature row of the chunk: log-sum-exp and top-k of its logits.
template <int KMAX, int THREADS>
__global__ void __launch_bounds__(THREADS) contrastive_row_topk_kernel(ContrastiveParams p, int64_t row0) {
  __shared__ BlockTopKShared<float, KMAX, THREADS> sel;
  __shared__ float red[THREADS / kWarp];
  const int64_t row = row0 + blockIdx.x, V = p.vocab, k = p.k;
  const float* l = p.logits + static_cast<int64_t>(blockIdx.x) * V;

  auto load = [&](int64_t i) { return l[i]; };
  float m = neg_inf(), bad = 0.f;
  strided_for<THREADS>(V, load, [&](int64_t, float x) {
    m = fmaxf(m, x);
    if (poisons(x)) bad = 1.f;
  });
  OnlineSoftmax st;
  st.max = block_max(m, red);
  const bool poisoned = block_max(bad, red) > 0.f;  // a NaN or +inf logit
  float s = 0.f;
  if (!poisoned && st.max != neg_inf()) strided_for<THREADS>(V, load, [&](int64_t, float x) { s += expf(x - st.max); });
  st.sum = block_sum(s, red);
  const float lse = st.lse();

  float* out_lp = p.logprobs + row * k;
  int64_t* out_id = p.token_ids + row * k;
  if (poisoned || st.sum == 0.f) return write_no_distribution(out_lp, out_id, k);  // block-uniform
  block_topk<KMAX, THREADS>(
      V, k,
      [&](int64_t i, float& v) {
        v = l[i];
        return true;
      },
      sel,
      [&](int64_t rank, float v, int64_t i) {
        if (threadIdx.x == rank % THREADS) {
          out_lp[rank] = v - lse;
          out_id[rank] = i;
        }
        return true;
      });
}

// Split top-k, first half: block (slice, row of the chunk) writes its slice's max, sum of
// exp(logit - max) and top-min(k, slice length) (logits and token ids, in rank order).
template <int KMAX>
__global__ void contrastive_split_topk_kernel(ContrastiveParams p) {
  using namespace contrastive;
  __shared__ BlockTopKShared<float, KMAX, kThreads> sel;
  __shared__ float red[kThreads / kWarp];
  const int64_t slice = blockIdx.x, row = blockIdx.y, V = p.vocab, k = p.k;
  const int64_t begin = slice * kSplitLen;
  const int64_t n = V - begin < kSplitLen ? V - begin : kSplitLen;
  const float* l = p.logits + row * V + begin;

  auto load = [&](int64_t i) { return l[i]; };
  float m = neg_inf(), bad = 0.f;
  strided_for<kThreads>(n, load, [&](int64_t, float x) {
    m = fmaxf(m, x);
    if (poisons(x)) bad = 1.f;
  });
  m = block_max(m, red);
  if (block_max(bad, red) > 0.f) {  // a NaN or +inf logit: the merge gives the row NaN / -1
    if (threadIdx.x == 0) p.split_max[row * p.splits + slice] = p.split_sum[row * p.splits + slice] = quiet_nan();
    return;  // block-uniform
  }
  float s = 0.f;
  if (m != neg_inf()) strided_for<kThreads>(n, load, [&](int64_t, float x) { s += expf(x - m); });
  s = block_sum(s, red);

  const int64_t out = (row * p.splits + slice) * k;
  block_topk<KMAX, kThreads>(
      n, k < n ? k : n,
      [&](int64_t i, float& v) {
        v = l[i];
        return true;
      },
      sel,
      [&](int64_t rank, float v, int64_t i) {
        if (threadIdx.x == rank % kThreads) {
          p.split_values[out + rank] = v;
          p.split_indices[out + rank] = begin + i;
        }
        return true;
      });
  if (threadIdx.x == 0) {
    p.split_max[row * p.splits + slice] = m;
    p.split_sum[row * p.splits + slice] = s;
  }
}

// Split top-k, second half: one block per row merges the slices' log-sum-exp and top-k lists.
// The lists are ranked by (logit, position in the [splits, k] buffer): for equal logits that
// is token id order, since slices hold increasing ids and each list is in rank order.
template <int KMAX>
__global__ void contrastive_split_merge_kernel(ContrastiveParams p, int64_t row0) {
  using namespace contrastive;
  __shared__ BlockTopKShared<float, KMAX, kThreads> sel;
  const int64_t row = blockIdx.x, V = p.vocab, k = p.k, splits = p.splits;
  const float* maxes = p.split_max + row * splits;
  const float* sums = p.split_sum + row * splits;
  OnlineSoftmax st;  // merged in every thread alike (a few slices)
  bool poisoned = false;
  for (int64_t j = 0; j < splits; ++j) {
    st.max = fmaxf(st.max, maxes[j]);
    poisoned |= sums[j] != sums[j];
  }
  for (int64_t j = 0; j < splits; ++j) st.sum += sums[j] * merge_weight(maxes[j], st.max);
  const float lse = st.lse();

  const float* values = p.split_values + row * splits * k;
  const int64_t* ids = p.split_indices + row * splits * k;
  float* out_lp = p.logprobs + (row0 + row) * k;
  int64_t* out_id = p.token_ids + (row0 + row) * k;
  if (poisoned || !(st.sum > 0.f)) return write_no_distribution(out_lp, out_id, k);  // block-uniform
  block_topk<KMAX, kThreads>(
      splits * k, k,
      [&](int64_t j, float& v) {
        const int64_t slice = j / k;
        const int64_t len = V - slice * kSplitLen < kSplitLen ? V - slice * kSplitLen : kSplitLen;
        if (j % k >= len) return false;  // a short last slice has fewer than k
        v = values[j];
        return true;
      },
      sel,
      [&](int64_t rank, float v, int64_t j) {
        if (threadIdx.x == rank % kThreads) {
          out_lp[rank] = v - lse;
          out_id[rank] = ids[j];
        }
        return true;
      });
}

template <typename scalar_t>
void launch_contrastive_topk(const ContrastiveParams& p, cudaStream_t stream) {
  using namespace contrastive;
  if (p.rows == 0) return;
  const int64_t elems = p.rows * p.hidden;
  const int64_t feature_blocks = (elems + kThreads - 1) / kThreads < 65535 ? (elems + kThreads - 1) / kThreads : 65535;
  JAKIRO_LAUNCH(feature_blocks, kThreads, 0, stream, contrastive_features_kernel<scalar_t>)(p);
  const int64_t vocab_blocks = (p.vocab + kVocabTile - 1) / kVocabTile;
  // 16-byte loads when every row starts 16-byte aligned (the features scratch always does).
  constexpr int kPack = static_cast<int>(sizeof(Pack16) / sizeof(scalar_t));
  const bool vectorized = p.hidden % kPack == 0 && reinterpret_cast<uintptr_t>(p.lm_head) % sizeof(Pack16) == 0 &&
                          reinterpret_cast<uintptr_t>(p.features) % sizeof(Pack16) == 0;
  for (int64_t row0 = 0; row0 < p.rows; row0 += p.scratch_rows) {
    const int64_t nrows = p.rows - row0 < p.scratch_rows ? p.rows - row0 : p.scratch_rows;
    if (vectorized) {
      JAKIRO_LAUNCH(vocab_blocks, kThreads, 0, stream, contrastive_logits_kernel<scalar_t, kPack>)(p, row0, nrows);
    } else {
      JAKIRO_LAUNCH(vocab_blocks, kThreads, 0, stream, contrastive_logits_kernel<scalar_t, 1>)(p, row0, nrows);
    }
    if (p.splits > 1) {
      JAKIRO_LAUNCH(dim3(static_cast<unsigned>(p.splits), static_cast<unsigned>(nrows)), kThreads, 0, stream,
                    contrastive_split_topk_kernel<kTopK>)(p);
      JAKIRO_LAUNCH(nrows, kThreads, 0, stream, contrastive_split_merge_kernel<kTopK>)(p, row0);
    } else if (p.vocab >= kWideVocab) {
      JAKIRO_LAUNCH(nrows, kWideThreads, 0, stream, contrastive_row_topk_kernel<kTopK, kWideThreads>)(p, row0);
    } else {
      JAKIRO_LAUNCH(nrows, kThreads, 0, stream, contrastive_row_topk_kernel<kTopK, kThreads>)(p, row0);
    }
  }
}

}  // namespace jakiro::gpu
