// CPU kernels of tree attention over a KV cache (split-KV, FlashDecoding-style); the split
// results are combined by merge_attention_states (merge_attention_states.cpp).
//
// One task = (sequence b, KV head, split). It gathers the G = Hq / Hkv query heads that share
// the KV head, times the T tree tokens, into one [G*T, D] block, so every K/V row loaded from
// the cache serves all of them. Keys are consumed in blocks of kBlock: scores by a GEMM,
// online softmax, then P @ V by a second GEMM. A decoding tree (automatic splits) takes each
// token's visible tree keys in order after the prefix, as its one-token step would see them
// (attend_tree_in_order); a prompt's chunk, or splits the caller chose, masks the tree keys in
// place from the bit-packed ancestor mask. A large tree makes this compute-bound (G*T rows per
// K/V row); with few rows (small trees, plain decoding) it is bound by reading K/V, and both
// products stream the cache instead. A bf16 cache (beside bf16 or float32 queries) is widened to
// float32: in registers by the 512-bit streamed products, else per block; accumulation is float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/merge_attention_states.h"
#include "cpu/tree_attention.h"
#include "cpu/vec_utils.h"
#include "jakiro/common.h"
#include "jakiro/softmax.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

// Up to this many query rows (G * T) per task the products are bound by reading K/V: they
// stream it (skinny_gemm.h) instead of calling a BLAS GEMM, which is for the many-row
// (compute-bound) case of a prompt's tiles (a tree streams whatever its rows: see attend_one_split). (An AMD EPYC, Zen 5, the default model's 3-query-head
// groups behind 256 tokens: a forward of 3 / 4 tokens 0.96 / 0.98x the time with 32 against 8,
// 6 / 8 tokens the same; an Intel Xeon measured 64 against 8 the same.)
constexpr int64_t kStreamingRows = 32;

// The float32 rows [start, start + n) of one head's [S, D] cache: the cache itself when it
// is float32, else widened into `buffer`.
inline const float* float_rows(const float* head, int64_t start, int64_t n, int64_t dim, std::vector<float>&) {
  return head + start * dim;
}
inline const float* float_rows(const c10::BFloat16* head, int64_t start, int64_t n, int64_t dim,
                               std::vector<float>& buffer) {
  to_float(head + start * dim, buffer.data(), n * dim);
  return buffer.data();
}

// acc[r, :] += sum_j p[r, j] * v[j, :] for few rows r: every V row is read once per row of P,
// from L2. Each output element is one chain of fused multiply-adds over j in order, whatever the
// vector width; Width accumulator vectors along D at a time keep that many chains in flight (one
// chain waits a multiply-add's latency per key: with 4 of them a 4-token tree behind 1,024 keys
// took a fifth of the forward, Zen 5).
template <int Width>
inline int64_t accumulate_pv_columns(const float* pr, int64_t n, const float* v, int64_t D, float* o, int64_t d) {
  constexpr int64_t step = Width * Vec::size();
  for (; d + step <= D; d += step) {
    Vec a[Width];
    for (int i = 0; i < Width; ++i) a[i] = Vec::loadu(o + d + i * Vec::size());
    for (int64_t j = 0; j < n; ++j) {
      const Vec pj(pr[j]);
      const float* vj = v + j * D + d;
      for (int i = 0; i < Width; ++i) a[i] = at::vec::fmadd(pj, Vec::loadu(vj + i * Vec::size()), a[i]);
    }
    for (int i = 0; i < Width; ++i) a[i].store(o + d + i * Vec::size());
  }
  return d;
}

void accumulate_pv_streaming(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t D,
                             float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * ldp;
    float* o = acc + r * D;
    int64_t d = accumulate_pv_columns<8>(pr, n, v, D, o, 0);
    d = accumulate_pv_columns<4>(pr, n, v, D, o, d);
    for (; d < D; ++d) {
      float a = o[d];
      for (int64_t j = 0; j < n; ++j) a += pr[j] * v[j * D + d];
      o[d] = a;
    }
  }
}

// acc[r, :] += sum_j p[r, j] * v[j, :] over the keys row r attends to only: the prefix and the
// tree nodes its mask row sets. For a block holding a non-finite tree value, which must not
// reach the rows that do not see it (0 * NaN is NaN).
void accumulate_pv_visible(const float* p, int64_t rows, int64_t n, const float* v, int64_t D, float* acc,
                           const int64_t* tree_mask, int64_t mask_stride, int64_t tree_len, int64_t key0,
                           int64_t prefix) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* mask_row = tree_mask + (r % tree_len) * mask_stride;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = key0 + j;
      if (key < prefix || mask_bit(mask_row, key - prefix)) axpy(acc + r * D, v + j * D, D, p[r * n + j]);
    }
  }
}

// One past the last tree position any of the mask rows [t0, t1) of sequence b sets (0: none).
int64_t tree_keys_seen(const PartialArgs& a, int64_t b, int64_t t0, int64_t t1) {
  const int64_t T = a.shape.tree_len, words = (T + 63) / 64;
  int64_t end = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t* row = a.tree_mask + (b * T + t) * a.mask_stride;
    for (int64_t w = words - 1; w >= 0 && 64 * (w + 1) > end; --w) {
      uint64_t word = static_cast<uint64_t>(row[w]);
      if (w == words - 1 && T % 64 != 0) word &= (uint64_t{1} << (T % 64)) - 1;  // bits past T: not keys
      if (word != 0) {
        end = std::max<int64_t>(end, 64 * w + 64 - __builtin_clzll(word));
        break;
      }
    }
  }
  return end;
}

// Sets srow[j - j0] to -inf for the keys j in [first, end) (tree positions j - prefix) that the
// mask row does not set, a 64-bit word at a time.
inline void mask_scores(const int64_t* mask_row, int64_t prefix, int64_t first, int64_t end, int64_t j0,
                        float* srow) {
  for (int64_t j = first; j < end;) {
    const int64_t bit = j - prefix, offset = bit & 63;
    const int64_t span = std::min<int64_t>(64 - offset, end - j);
    uint64_t hidden = ~(static_cast<uint64_t>(mask_row[bit >> 6]) >> offset);
    if (span < 64) hidden &= (uint64_t{1} << span) - 1;
    for (; hidden != 0; hidden &= hidden - 1) srow[j + __builtin_ctzll(hidden) - j0] = neg_inf();
    j += span;
  }
}

// Folds one block's scores of a row (srow[0, n), masked ones -inf) into its online softmax: the
// row's accumulated values rescaled, srow turned into exp(score - max) (zeros where it contributes
// nothing). A NaN or +inf score poisons the row.
inline void fold_scores(float* srow, int64_t n, OnlineSoftmax& state, float* acc_row, int64_t D) {
  const float block_max = n > 0 ? max_of(srow, n) : neg_inf();
  if (poisons(block_max)) {
    state.poison();
    std::fill(srow, srow + n, 0.f);
    return;
  }
  if (block_max == neg_inf()) {  // fully masked in this block: contributes nothing
    std::fill(srow, srow + n, 0.f);
    return;
  }
  const float factor = state.rescale_for(block_max);
  if (factor != 1.f) scale_in_place(acc_row, D, factor);
  state.sum += exp_shift_sum_fast(srow, n, state.max);
}

// The streamed products for few rows, float32 or bf16 keys: scores s[r * lds + j] of keys [j0, j0 + n)
// of one head's cache, and acc[r] += p[r * ldp + j] v[j0 + j] (a bf16 block widened into `buffer`
// where 512-bit vectors are not used). Every score and every chain is the same bits whatever the
// rows and wherever the keys' run is cut (attention_avx512.cpp, skinny_gemm.h).
template <typename cache_t>
void streamed_scores(bool wide, const float* q, int64_t rows, const cache_t* k_head, int64_t j0, int64_t n, int64_t D,
                     float* s, int64_t lds) {
  if (wide) {
    attention_scores_avx512(q, rows, k_head + j0 * D, n, D, s, lds);
  } else {
    skinny_gemm_nt(q, rows, D, k_head, D, D, j0, j0 + n, s, lds);
  }
}
template <typename cache_t>
void streamed_pv(bool wide, const float* p, int64_t ldp, int64_t rows, const cache_t* v_head, int64_t j0, int64_t n,
                 int64_t D, float* acc, std::vector<float>& buffer) {
  if (wide) {
    attention_pv_avx512(p, ldp, rows, n, v_head + j0 * D, D, acc);
  } else {
    accumulate_pv_streaming(p, ldp, rows, n, float_rows(v_head, j0, n, D, buffer), D, acc);
  }
}

// A tree's rows (T <= kFixedSplitTreeLen): row r attends to the prefix, then to the tree keys its
// mask row sets in index order, as one run of keys (its logical positions: prefix + 0, 1, ...),
// cut into splits and blocks where that run is. A one-token step of the same token, its ancestors
// committed (their keys the prefix's last), sees the same run: its result is the same bits,
// whatever siblings the tree holds between them (a quantized target's next layer re-quantizes the
// row, so a last-bit difference there can change a token). The keys of the task's split are the
// logical positions [start, stop); a row's visible tree keys are gathered from wherever they are.
template <typename cache_t>
void attend_tree_in_order(const PartialArgs& a, const cache_t* k_head, const cache_t* v_head, int64_t b,
                          int64_t start, int64_t stop, int64_t rows, bool wide, SplitScratch& s) {
  const int64_t T = a.shape.tree_len, D = a.shape.head_dim, prefix = a.prefix_lens[b];
  // Each tree token's visible tree keys, in index order (shared by its G query rows r = g * T + t):
  // the set bits of its mask row below T, a 64-bit word at a time.
  s.visible.resize(T * T);
  s.visible_count.assign(T, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* mask_row = a.tree_mask + (b * T + t) * a.mask_stride;
    for (int64_t w = 0; 64 * w < T; ++w) {
      uint64_t word = static_cast<uint64_t>(mask_row[w]);
      if (T - 64 * w < 64) word &= (uint64_t{1} << (T - 64 * w)) - 1;  // bits past T: not keys
      for (; word != 0; word &= word - 1) s.visible[t * T + s.visible_count[t]++] = 64 * w + __builtin_ctzll(word);
    }
  }
  if (stop > prefix) {  // the split reaches the tree: every row's scores of the T tree keys
    s.tree_scores.resize(rows * T);
    streamed_scores(wide, s.q.data(), rows, k_head, prefix, T, D, s.tree_scores.data(), T);
    s.tree_values.resize(T * D);
  }
  for (int64_t j0 = start; j0 < stop; j0 += kBlock) {
    const int64_t n = std::min(kBlock, stop - j0);
    const int64_t in_prefix = std::clamp<int64_t>(prefix - j0, 0, n);  // the block's prefix keys
    if (in_prefix > 0) streamed_scores(wide, s.q.data(), rows, k_head, j0, in_prefix, D, s.scores.data(), kBlock);
    // Row r's visible tree keys [k0, k1) of its run fall in this block, after its prefix keys.
    const int64_t k0 = std::max<int64_t>(0, j0 - prefix);
    auto tree_end = [&](int64_t t) {
      return std::clamp<int64_t>(j0 + n - prefix, k0, std::max(k0, s.visible_count[t]));
    };
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r % T, k1 = tree_end(t);
      float* srow = s.scores.data() + r * kBlock;
      for (int64_t k = k0; k < k1; ++k) srow[in_prefix + k - k0] = s.tree_scores[r * T + s.visible[t * T + k]];
      fold_scores(srow, in_prefix + (k1 - k0), s.state[r], s.acc.data() + r * D, D);
    }
    if (in_prefix > 0) streamed_pv(wide, s.scores.data(), kBlock, rows, v_head, j0, in_prefix, D, s.acc.data(), s.v);
    for (int64_t t = 0; t < T; ++t) {  // the chains go on over each token's visible tree values
      const int64_t k1 = tree_end(t);
      if (k1 == k0) continue;
      for (int64_t k = k0; k < k1; ++k)
        to_float(v_head + (prefix + s.visible[t * T + k]) * D, s.tree_values.data() + (k - k0) * D, D);
      for (int64_t r = t; r < rows; r += T)
        streamed_pv(wide, s.scores.data() + r * kBlock + in_prefix, kBlock, 1, s.tree_values.data(), 0, k1 - k0, D,
                    s.acc.data() + r * D, s.v);
    }
  }
}

}  // namespace

template <typename scalar_t, typename cache_t>
void attend_one_split(const PartialArgs& a, const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache,
                      int64_t k_batch_stride, int64_t k_head_stride, int64_t b, int64_t kvh, int64_t split,
                      int64_t t0, int64_t t1, int64_t g0, int64_t g1, SplitScratch& s) {
  const auto& sh = a.shape;
  const int64_t T = sh.tree_len, D = sh.head_dim, G = sh.group(), tile = t1 - t0, rows = (g1 - g0) * tile;
  const int64_t prefix = a.prefix_lens[b], kv_len = prefix + T;
  const int64_t chunk = a.split_len > 0 ? a.split_len : (kv_len + a.num_splits - 1) / a.num_splits;
  const int64_t start = std::min(kv_len, split * chunk);
  int64_t stop = std::min(kv_len, start + chunk);
  // A tile of a longer run reads no key after the last its rows see (the whole tree, the keys
  // every row sees, reads them all: its results stay those of any tree of its length).
  if (tile < T) stop = std::max(start, std::min(stop, prefix + tree_keys_seen(a, b, t0, t1)));

  auto out_row = [&](int64_t g, int64_t t) {
    const int64_t h = kvh * G + g;
    return ((b * T + t0 + t) * sh.q_heads + h) * a.num_splits + split;
  };

  // Gather the query rows r = (g - g0) * tile + t (head kvh * G + g, tree token t0 + t), pre-scaled.
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t t = 0; t < tile; ++t) {
      float* dst = s.q.data() + ((g - g0) * tile + t) * D;
      to_float(q + ((b * T + t0 + t) * sh.q_heads + kvh * G + g) * D, dst, D);
      scale_in_place(dst, D, a.scale);
    }
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.state.begin(), s.state.end(), OnlineSoftmax{});

  const cache_t* k_head = k_cache + b * k_batch_stride + kvh * k_head_stride;
  const cache_t* v_head = v_cache + b * k_batch_stride + kvh * k_head_stride;
  // Few rows on 512-bit vectors (cpu/attention_avx512.cpp): both products read float32 or bf16
  // keys and values (widened in registers); the other paths widen a bf16 block first (float_rows).
  const bool wide = D % 16 == 0 && D <= kMaxAttentionDim && avx512_enabled();
  if (a.split_len > 0 && T <= kFixedSplitTreeLen) {  // a tree in fixed splits (decoding): each row's keys in order
    attend_tree_in_order(a, k_head, v_head, b, start, stop, rows, wide, s);
  } else {  // a prompt's chunk in tiles, or splits the caller chose: the masked keys in place
    // A tree always streams: the streamed products compute each row alike whatever the rows, so a
    // token's attention is the same bits in a tree of 60 as alone (BLAS's blocking is not: 1e-5
    // apart, enough to flip a quantized activation's code).
    const bool streaming = rows <= kStreamingRows || T <= kFixedSplitTreeLen;
    for (int64_t j0 = start; j0 < stop; j0 += kBlock) {
      const int64_t n = std::min(kBlock, stop - j0);
      if (streaming) {
        streamed_scores(wide, s.q.data(), rows, k_head, j0, n, D, s.scores.data(), n);
      } else {
        gemm_nt(s.q.data(), D, float_rows(k_head, j0, n, D, s.k), D, s.scores.data(), n, rows, n, D);
      }
      if (j0 + n > prefix) {  // the block reaches into the tree: apply the ancestor mask
        const int64_t first = std::max(j0, prefix);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t* mask_row = a.tree_mask + (b * T + t0 + r % tile) * a.mask_stride;
          mask_scores(mask_row, prefix, first, j0 + n, j0, s.scores.data() + r * n);
        }
      }
      for (int64_t r = 0; r < rows; ++r) fold_scores(s.scores.data() + r * n, n, s.state[r], s.acc.data() + r * D, D);
      const int64_t tree_col = std::max<int64_t>(0, prefix - j0);  // first tree key of the block
      if (tree_col < n && !all_finite(v_head + (j0 + tree_col) * D, (n - tree_col) * D)) {
        accumulate_pv_visible(s.scores.data(), rows, n, float_rows(v_head, j0, n, D, s.v), D, s.acc.data(),
                              a.tree_mask + (b * T + t0) * a.mask_stride, a.mask_stride, tile, j0, prefix);
      } else if (streaming) {
        streamed_pv(wide, s.scores.data(), n, rows, v_head, j0, n, D, s.acc.data(), s.v);
      } else {
        gemm_nn_accumulate(s.scores.data(), n, float_rows(v_head, j0, n, D, s.v), D, s.acc.data(), D, rows, D, n);
      }
    }
  }

  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t t = 0; t < tile; ++t) {
      const int64_t r = (g - g0) * tile + t, o = out_row(g, t);
      const OnlineSoftmax& st = s.state[r];
      float* dst = a.out_partial + o * D;
      from_float(s.acc.data() + r * D, dst, D);
      scale_in_place(dst, D, st.inv_sum());
      a.lse_partial[o] = st.lse();
    }
  }
}

template void attend_one_split<float>(const PartialArgs&, const float*, const float*, const float*, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, SplitScratch&);
template void attend_one_split<c10::BFloat16>(const PartialArgs&, const c10::BFloat16*, const c10::BFloat16*,
                                              const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                              int64_t, int64_t, int64_t, int64_t, SplitScratch&);
template void attend_one_split<float, c10::BFloat16>(const PartialArgs&, const float*, const c10::BFloat16*,
                                                     const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                     int64_t, int64_t, int64_t, int64_t, SplitScratch&);

namespace {

std::tuple<at::Tensor, at::Tensor> partial_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                     const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                                     const at::Tensor& tree_mask, int64_t num_splits,
                                                     std::optional<double> scale, int64_t split_len) {
  const char* op = "jakiro::tree_attention_partial";
  const auto sh = check_tree_attention(op, q, k_cache, v_cache, prefix_lens, tree_mask, /*bf16_cache=*/true);
  TORCH_CHECK(num_splits >= 1, op, ": num_splits must be >= 1, got ", num_splits);
  auto qc = q.contiguous();
  auto lens = prefix_lens.contiguous();
  auto mask = tree_mask.contiguous();
  auto fopts = q.options().dtype(at::kFloat);
  auto out_partial = at::empty({sh.batch, sh.tree_len, sh.q_heads, num_splits, sh.head_dim}, fopts);
  auto lse_partial = at::empty({sh.batch, sh.tree_len, sh.q_heads, num_splits}, fopts);

  PartialArgs args{sh,
                   num_splits,
                   split_len,
                   attention_scale(op, scale, sh.head_dim),
                   lens.data_ptr<int64_t>(),
                   mask.data_ptr<int64_t>(),
                   mask.size(2),
                   out_partial.data_ptr<float>(),
                   lse_partial.data_ptr<float>()};
  // A longer run (a prompt's chunk) goes in tiles of tokens; the last tiles first (in a causal
  // chunk they see the most keys), each worker taking the next task when it is done with one.
  const int64_t tile = tile_tokens(sh.tree_len);
  const int64_t tiles = (sh.tree_len + tile - 1) / tile, per_tile = sh.batch * sh.kv_heads * num_splits;
  const int64_t tasks = per_tile * tiles;
  std::atomic<int64_t> next{0};
  auto run = [&](const auto* qp, const auto* kp, const auto* vp) {
    using cache_t = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
      c10::InferenceMode worker_guard;  // for the GEMMs on scratch buffers; outputs are allocated outside
      SplitScratch scratch(sh.group() * std::min(tile, sh.tree_len), sh.head_dim, !std::is_same_v<cache_t, float>);
      for (int64_t task = next++; task < tasks; task = next++) {
        const int64_t t0 = (tiles - 1 - task / per_tile) * tile, rest = task % per_tile;
        const int64_t split = rest % num_splits, kvh = (rest / num_splits) % sh.kv_heads;
        const int64_t b = rest / (num_splits * sh.kv_heads);
        attend_one_split(args, qp, kp, vp, k_cache.stride(0), k_cache.stride(1), b, kvh, split, t0,
                         std::min(sh.tree_len, t0 + tile), 0, sh.group(), scratch);
      }
    });
  };
  with_cache_dtypes(qc, k_cache, v_cache, run);
  return {out_partial, lse_partial};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                                      const at::Tensor& tree_mask, std::optional<double> scale,
                                                      std::optional<int64_t> num_splits) {
  int64_t splits, split_len = 0;
  if (num_splits.has_value()) {
    splits = *num_splits;
  } else {
    const auto sh = check_tree_attention("jakiro::tree_attention", q, k_cache, v_cache, prefix_lens, tree_mask,
                                         /*bf16_cache=*/true);
    // The longest prefix as the check read it (the CPU's lengths are always on the host); an
    // ATen max().item() here cost ~5 us a call, once per layer and token.
    const int64_t max_kv = sh.longest_prefix + sh.tree_len;
    if (sh.tree_len <= kFixedSplitTreeLen) {
      split_len = kMinSplitLen;
      splits = fixed_splits(max_kv);
    } else {  // tiles of a longer run spread the work (partial_attention); splits only where they are too few
      const int64_t tile = tile_tokens(sh.tree_len), tiles = (sh.tree_len + tile - 1) / tile;
      splits = default_num_splits(sh.batch * tiles, sh.kv_heads, max_kv, at::get_num_threads(), kMinSplitLen);
    }
  }
  auto [out_partial, lse_partial] =
      partial_attention(q, k_cache, v_cache, prefix_lens, tree_mask, splits, scale, split_len);
  return merge_attention_states_cpu(out_partial, lse_partial, q.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> tree_attention_partial_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                              const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                                              const at::Tensor& tree_mask, int64_t num_splits,
                                                              std::optional<double> scale) {
  return partial_attention(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits, scale, 0);
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) {
  m.impl("tree_attention", &tree_attention_cpu);
  m.impl("tree_attention_partial", &tree_attention_partial_cpu);
}

}  // namespace jakiro::cpu
