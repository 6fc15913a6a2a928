// CPU kernels of jakiro::decoder_layer (a Llama decoder layer in one call), jakiro::decoder_layers
// (a model's layers in one call) and jakiro::silu_mul (the SwiGLU activation of the fused
// [gate | up] projection in one pass).
//
// Layers of a few rows (decoding, a draft or verification tree: at most kLinearStreamRows
// tokens) run as one parallel region: every thread takes a share of every stage (a block of
// each projection's output columns, of the RoPE heads, of the attention's split-KV tasks and of
// the merged rows), the stages separated by barriers, and each thread computes the norms of all
// rows for itself (a row of H values: cheaper than a barrier); decoder_layers runs all its
// layers in the one region. Composed of the ops instead, a layer is seven parallel regions with
// the small stages on one thread between them, run cold after each projection's weight stream,
// and ~15 allocations. Every value comes from the row kernels the ops use (cpu/layer_rows.h,
// cpu/linear.h, cpu/tree_attention.h), so both forms give the same bits
// (python_tests/ops/test_decoder_layer.py). Longer inputs (a prompt's chunk) and
// JAKIRO_CPU_FUSED_LAYER=0 compose the ops (csrc/decoder_layer.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/layer_rows.h"
#include "cpu/linear.h"
#include "cpu/merge_attention_states.h"
#include "cpu/quantized.h"
#include "cpu/skinny_avx512.h"
#include "cpu/tree_attention.h"
#include "decoder_layer.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

constexpr int64_t kSiluRowsPerTask = 8;

struct CpuOps {
  static constexpr bool kBf16Weights = true, kBf16Cache = true;
  std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                                              const std::optional<at::Tensor>& residual) const {
    return rms_norm_cpu(x, w, eps, residual);
  }
  at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) const {
    return linear_cpu(x, w, b);
  }
  at::Tensor rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& kv_cache, const at::Tensor& lengths) const {
    return rope_kv_write_cpu(qkv, cos, sin, kv_cache, lengths);
  }
  at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths,
                            const at::Tensor& mask) const {
    return std::get<0>(tree_attention_cpu(q, k, v, lengths, mask, std::nullopt, std::nullopt));
  }
  at::Tensor silu_mul(const at::Tensor& gate_up) const { return silu_mul_cpu(gate_up); }
};

// A barrier for the roles of one parallel region. An invocation of at::parallel_for's body may
// play several roles (a team smaller than asked for, or a call from inside another region, which
// runs the whole range on one thread): it does each stage for all of its roles, then arrives for
// all of them at once, so the barrier never waits for a role nobody plays.
class RoleBarrier {
  // A spinning role leaves the core's load ports and memory requests to the roles still working.
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

 public:
  explicit RoleBarrier(int64_t roles) : roles_(roles) {}
  void arrive_and_wait(int64_t roles) {
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(roles, std::memory_order_acq_rel) + roles == roles_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation;) {
      if (spins < 4096) {
        ++spins;
        pause();
      } else {
        std::this_thread::yield();  // (more threads than free cores)
      }
    }
  }

 private:
  const int64_t roles_;
  std::atomic<int64_t> arrived_{0}, generation_{0};
};

// [begin, end) of role `role`'s contiguous share of n units among `roles`.
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t role, int64_t roles) {
  return {n * role / roles, n * (role + 1) / roles};
}

bool fused_layer_enabled() {
  static const bool enabled = !env_disabled("JAKIRO_CPU_FUSED_LAYER");
  return enabled;
}

// Scratch bytes that start on a cache line, as a tensor's do. The products load every input row
// once per 16 weights: a row that straddles cache lines costs each of those loads two (a 2-core
// Zen 5 EPYC, a forward of 5 tokens behind 300: 1.12x the composed ops' time with the rows in a
// malloc'd vector, 16-byte aligned; 0.96x aligned).
class LineAligned {
 public:
  static constexpr size_t kLine = 64;
  void resize(size_t n) { bytes_.resize(n + kLine); }
  template <typename T>
  T* as() {
    const auto p = reinterpret_cast<uintptr_t>(bytes_.data());
    return reinterpret_cast<T*>((p + kLine - 1) / kLine * kLine);
  }

 private:
  std::vector<char> bytes_;
};

// What one role keeps for itself across the stages, reused from call to call: once the largest
// shape has been seen, nothing is allocated for a call but its outputs.
struct RoleScratch {
  LineAligned normed;          // the norm of every row (h, then h2): [M, H] scalar_t
  LineAligned sums;            // the residual sums of the rows other roles write: [M, H] scalar_t
  LineAligned gate_up;         // this role's gate and up columns: 2 x [M, n] scalar_t
  LineAligned widened;         // a stage's input rows widened to float32 (bf16 without dot products)
  QuantizedRows quantized;     // a stage's input rows quantized (packed quantized weights)
  std::vector<float> norm, product, silu, merge;
  SplitScratch attention;
};

// One layer's tensors, as jakiro::decoder_layer takes them (kv_cache: its [2, B, Hkv, S, D]).
struct LayerTensors {
  at::Tensor input_norm, qkv_weight;
  std::optional<at::Tensor> qkv_bias;
  at::Tensor o_weight, post_norm, gate_up_weight, down_weight, kv_cache;
};

// What the stages read of one layer: its weights' pointers (contiguous copies kept alive in
// `kept`) and its cache's.
template <typename scalar_t, typename weight_t, typename cache_t>
struct LayerPointers {
  const weight_t *qkv, *o, *gate_up, *down;
  QuantFormat qkv_format, o_format, gate_up_format, down_format;  // packed quantized weights' (uint8 weight_t)
  const scalar_t *input_norm, *post_norm, *qkv_bias;
  cache_t *keys, *values;
  int64_t batch_stride, head_stride;
  std::vector<at::Tensor> kept;
};

// weight_t: the projections' weights, scalar_t, or beside float32 activations bf16 (check_weight_dtype)
// or uint8: packed quantized (jakiro/quant.h, cpu/quantized.h; their rows quantized per stage by
// each role for itself, as the norms are). cache_t: the KV cache's, scalar_t or beside float32
// activations bf16 (check_cache_dtype).
// The layers one after the other, every stage of every layer in one parallel region.
template <typename scalar_t, typename weight_t = scalar_t, typename cache_t = scalar_t>
std::tuple<at::Tensor, at::Tensor> fused_decoder_layers(const DecoderLayerShape& s, const at::Tensor& delta,
                                                        const std::optional<at::Tensor>& residual,
                                                        const std::vector<LayerTensors>& layers, const at::Tensor& cos,
                                                        const at::Tensor& sin, const at::Tensor& lengths,
                                                        const at::Tensor& tree_mask, double eps) {
  constexpr bool is_float = std::is_same_v<scalar_t, float>;
  constexpr bool quantized = std::is_same_v<weight_t, uint8_t>;
  const int64_t B = s.batch, T = s.tokens, M = B * T, H = s.hidden, Hq = s.q_heads, Hkv = s.kv_heads,
                D = s.head_dim, I = s.intermediate, QKV = (Hq + 2 * Hkv) * D, L = static_cast<int64_t>(layers.size());
  const auto options = delta.options();
  const auto x = delta.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), lens = lengths.contiguous(),
             mask = tree_mask.contiguous();
  const at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();

  // The buffers the stages share, kept by the calling thread from call to call.
  const int64_t n_qkv = M * QKV, n_q = M * Hq * D;
  thread_local LineAligned shared;
  shared.resize((n_qkv + 2 * n_q + 2 * M * H + M * I) * sizeof(scalar_t));
  scalar_t* qkv = shared.as<scalar_t>();
  scalar_t *q = qkv + n_qkv, *attn = q + n_q, *o = attn + n_q, *stream = o + M * H, *act = stream + M * H;
  // Each layer's cache positions and the mask, checked as rope_kv_write and tree_attention check
  // them; a later layer's cache of layer 0's sizes, strides, dtype and device passes as layer 0's
  // did (the checks read nothing else of it beside the shared rows, lengths and mask: 30 layers
  // checked anew cost ~40 us a decoding step, 1% of the quantized default model's).
  std::vector<LayerPointers<scalar_t, weight_t, cache_t>> ptrs(L);
  TreeAttentionShape attention_shape{};
  const at::Tensor& first_cache = layers[0].kv_cache;
  for (int64_t l = 0; l < L; ++l) {
    const LayerTensors& t = layers[l];
    auto& p = ptrs[l];
    if (l == 0 || t.kv_cache.sizes() != first_cache.sizes() || t.kv_cache.strides() != first_cache.strides() ||
        t.kv_cache.scalar_type() != first_cache.scalar_type() || t.kv_cache.device() != first_cache.device()) {
      check_rope_kv_write(at::from_blob(qkv, {B, T, Hq + 2 * Hkv, D}, options), c, sn, t.kv_cache, lens,
                          CpuOps::kBf16Cache);
      attention_shape = check_tree_attention("jakiro::tree_attention", at::from_blob(q, {B, T, Hq, D}, options),
                                             t.kv_cache.select(0, 0), t.kv_cache.select(0, 1), lens, mask,
                                             CpuOps::kBf16Cache);
    }
    std::vector<at::Tensor> kept = {t.qkv_weight.contiguous(), t.o_weight.contiguous(), t.gate_up_weight.contiguous(),
                                    t.down_weight.contiguous(), t.input_norm.contiguous(), t.post_norm.contiguous()};
    if (t.qkv_bias.has_value()) kept.push_back(t.qkv_bias->contiguous());
    p.qkv = kept[0].data_ptr<weight_t>(), p.o = kept[1].data_ptr<weight_t>();
    auto format = [](const at::Tensor& w) {
      return w.scalar_type() == at::kByte ? quant_format_of_chunk(w.size(2)) : QuantFormat::kNone;
    };
    p.qkv_format = format(kept[0]), p.o_format = format(kept[1]);
    p.gate_up_format = format(kept[2]), p.down_format = format(kept[3]);
    p.gate_up = kept[2].data_ptr<weight_t>(), p.down = kept[3].data_ptr<weight_t>();
    p.input_norm = kept[4].data_ptr<scalar_t>(), p.post_norm = kept[5].data_ptr<scalar_t>();
    p.qkv_bias = t.qkv_bias.has_value() ? kept[6].data_ptr<scalar_t>() : nullptr;
    p.kept = std::move(kept);
    p.keys = t.kv_cache.data_ptr<cache_t>(), p.values = p.keys + t.kv_cache.stride(0);  // (its [0] and [1])
    p.batch_stride = t.kv_cache.stride(1), p.head_stride = t.kv_cache.stride(2);
  }
  // The attention's partial results: splits of kMinSplitLen keys over the longest sequence's keys.
  const int64_t splits = fixed_splits(attention_shape.longest_prefix + T), n_partial = M * Hq * splits * D;
  thread_local std::vector<float> partials;
  partials.resize(n_partial + M * Hq * (splits + 1));
  float *out_partial = partials.data(), *lse_partial = out_partial + n_partial, *lse = lse_partial + M * Hq * splits;
  const int64_t* len = lens.data_ptr<int64_t>();

  // Each layer's outputs, the residual stream after its attention block and its MLP's output,
  // alternate between two pairs: layer l reads the pair layer l - 1 wrote. Returned: the last.
  const at::Tensor outputs[2][2] = {{at::empty({B, T, H}, options), at::empty({B, T, H}, options)},
                                    {L > 1 ? at::empty({B, T, H}, options) : at::Tensor(),
                                     L > 1 ? at::empty({B, T, H}, options) : at::Tensor()}};
  scalar_t* pout[2][2] = {{outputs[0][0].data_ptr<scalar_t>(), outputs[0][1].data_ptr<scalar_t>()},
                          {L > 1 ? outputs[1][0].data_ptr<scalar_t>() : nullptr,
                           L > 1 ? outputs[1][1].data_ptr<scalar_t>() : nullptr}};
  const int64_t roles = std::max<int64_t>(1, at::get_num_threads());
  thread_local std::vector<RoleScratch> kept;
  if (static_cast<int64_t>(kept.size()) < roles) kept.resize(roles);
  std::vector<RoleScratch>& role_scratch = kept;  // (the calling thread's: the workers have their own thread_locals)
  const bool dot = !is_float && bf16_dot_enabled();
  for (int64_t r = 0; r < roles; ++r) {  // sized here: nothing is allocated inside the region
    RoleScratch& rs = role_scratch[r];
    rs.normed.resize(M * H * sizeof(scalar_t));
    rs.sums.resize(M * H * sizeof(scalar_t));
    rs.gate_up.resize(2 * M * I * sizeof(scalar_t));
    rs.widened.resize(dot || is_float ? 0 : M * std::max({H, I, Hq * D}) * sizeof(float));
    if constexpr (quantized) rs.quantized.reserve(M, std::max({H, I, Hq * D}));
    rs.norm.resize(H);
    rs.product.resize(is_float ? 0 : M * std::max({QKV, H, I}));
    rs.silu.resize(3 * I);
    rs.merge.resize(D);
    rs.attention.resize(attention_shape.group() * T, D, !std::is_same_v<cache_t, float>);
  }

  const scalar_t *px = x.data_ptr<scalar_t>(), *pres = res.defined() ? res.data_ptr<scalar_t>() : nullptr;
  const scalar_t *pcos = c.data_ptr<scalar_t>(), *psin = sn.data_ptr<scalar_t>();
  const int64_t G = attention_shape.group();
  // One split (every key within kMinSplitLen) and float32 rows: the split's normalised output is
  // the merged one (its weight exp(0) = 1), so the tasks write the rows themselves and the merge
  // stage, and its barrier, is skipped.
  const bool unmerged = splits == 1 && is_float;
  const PartialArgs attention{attention_shape, splits, kMinSplitLen,
                              attention_scale("jakiro::tree_attention", std::nullopt, D), len,
                              mask.data_ptr<int64_t>(), mask.size(2),
                              unmerged ? reinterpret_cast<float*>(attn) : out_partial, lse_partial};

  // y[:, j0:j1) = rows @ w[j0:j1)^T (+ bias) for a stage's input rows (M x K, scalar_t); packed
  // quantized weights (`format`) read the rows as quantized by the role, anew unless `same_rows`
  // (the rows of its previous call).
  auto project = [&](RoleScratch& rs, const scalar_t* rows, int64_t K, const weight_t* w, QuantFormat format,
                     const scalar_t* bias, int64_t j0, int64_t j1, scalar_t* y, int64_t ldy, bool same_rows = false) {
    if (j0 >= j1) return;
    if constexpr (quantized) {
      if (!same_rows) rs.quantized.quantize(rows, M, K);
      quantized_columns(rs.quantized, w, format, bias, j0, j1, y, ldy);
      return;
    } else {
    StreamedRows in;
    if constexpr (is_float) {
      in.f = rows;
    } else if (dot) {
      in.bf16 = rows;
    } else {
      to_float(rows, rs.widened.as<float>(), M * K);
      in.f = rs.widened.as<float>();
    }
    linear_columns<scalar_t, weight_t>(in, M, K, w, bias, j0, j1, y, ldy, rs.product.data());
    }
  };
  // Row j of a [N, K] weight (j a multiple of 16 for a packed one).
  auto weight_row = [](const weight_t* w, int64_t j, int64_t K, QuantFormat format) {
    if constexpr (quantized) return w + j * (K / kQuantBlock) * quant_block_bytes(format);
    return w + j * K;
  };
  auto columns = [&](int64_t N, int64_t role) {  // a role's output columns, in units of kColumnBlock
    const auto [b0, b1] = share((N + kColumnBlock - 1) / kColumnBlock, role, roles);
    return std::pair<int64_t, int64_t>{b0 * kColumnBlock, std::min(N, b1 * kColumnBlock)};
  };
  // The norm of every row into rs.normed; the residual sums of the role's own rows into `sums`.
  auto norm_rows = [&](RoleScratch& rs, int64_t role, const scalar_t* xs, const scalar_t* residuals,
                       const scalar_t* weight, scalar_t* sums) {
    const auto [own0, own1] = share(M, role, roles);
    for (int64_t m = 0; m < M; ++m) {
      scalar_t* sum = (m >= own0 && m < own1 ? sums : rs.sums.as<scalar_t>()) + m * H;
      rms_norm_row(xs + m * H, residuals == nullptr ? nullptr : residuals + m * H, weight, H,
                   static_cast<float>(eps), rs.normed.as<scalar_t>() + m * H, sum, rs.norm.data());
    }
  };
  // Layer l's input (the residual stream is residual + delta) and outputs.
  auto delta_in = [&](int64_t l) -> const scalar_t* { return l == 0 ? px : pout[(l - 1) % 2][1]; };
  auto residual_in = [&](int64_t l) -> const scalar_t* { return l == 0 ? pres : pout[(l - 1) % 2][0]; };

  constexpr int64_t kMerge = 3;  // stages[kMerge]: the attention's merge
  const std::function<void(int64_t, int64_t)> stages[] = {
      [&](int64_t l, int64_t role) {  // the input norm; the qkv projection's columns
        RoleScratch& rs = role_scratch[role];
        norm_rows(rs, role, delta_in(l), residual_in(l), ptrs[l].input_norm, stream);
        const auto [j0, j1] = columns(QKV, role);
        project(rs, rs.normed.as<scalar_t>(), H, ptrs[l].qkv, ptrs[l].qkv_format, ptrs[l].qkv_bias, j0, j1, qkv, QKV);
      },
      [&](int64_t l, int64_t role) {  // RoPE of q and k and the cache write, by (row, head)
        const auto& p = ptrs[l];
        const RopeKvWrite<scalar_t, cache_t> rope{qkv, pcos, psin, len, q, p.keys, p.values, T, Hq, Hkv, D,
                                                  p.batch_stride, p.head_stride};
        const int64_t per_row = rope.units_per_row();
        const auto [u0, u1] = share(M * per_row, role, roles);
        for (int64_t u = u0; u < u1; ++u) rope.unit(u / per_row, u % per_row);
      },
      [&](int64_t l, int64_t role) {  // the attention: the role's share of the split-KV tasks' query heads
        const auto& p = ptrs[l];
        const auto [u0, u1] = share(B * Hkv * splits * G, role, roles);
        for_query_head_runs(u0, u1, G, [&](int64_t task, int64_t g0, int64_t g1) {
          const int64_t split = task % splits, kvh = (task / splits) % Hkv, b = task / (splits * Hkv);
          attend_one_split(attention, q, p.keys, p.values, p.batch_stride, p.head_stride, b, kvh, split, 0, T, g0,
                           g1, role_scratch[role].attention);
        });
      },
      [&](int64_t, int64_t role) {  // their merge, by (row, head) (kMerge)
        const auto [r0, r1] = share(M * Hq, role, roles);
        for (int64_t row = r0; row < r1; ++row) {
          merge_attention_row(out_partial + row * splits * D, lse_partial + row * splits, splits, D,
                              role_scratch[role].merge.data(), attn + row * D, lse + row);
        }
      },
      [&](int64_t l, int64_t role) {  // the output projection's columns
        const auto [j0, j1] = columns(H, role);
        project(role_scratch[role], attn, Hq * D, ptrs[l].o, ptrs[l].o_format, nullptr, j0, j1, o, H);
      },
      [&](int64_t l, int64_t role) {  // the post-attention norm; the role's gate and up columns, their SiLU product
        RoleScratch& rs = role_scratch[role];
        norm_rows(rs, role, o, stream, ptrs[l].post_norm, pout[l % 2][0]);
        const auto [a, b] = columns(I, role);
        const int64_t n = b - a;
        scalar_t *gate = rs.gate_up.as<scalar_t>(), *up = gate + M * n;
        const QuantFormat f = ptrs[l].gate_up_format;
        project(rs, rs.normed.as<scalar_t>(), H, weight_row(ptrs[l].gate_up, a, H, f), f, nullptr, 0, n, gate, n);
        project(rs, rs.normed.as<scalar_t>(), H, weight_row(ptrs[l].gate_up, I + a, H, f), f, nullptr, 0, n, up, n,
                /*same_rows=*/true);
        for (int64_t m = 0; m < M && n > 0; ++m) silu_mul_row(gate + m * n, up + m * n, n, act + m * I + a, rs.silu);
      },
      [&](int64_t l, int64_t role) {  // the down projection's columns
        const auto [j0, j1] = columns(H, role);
        project(role_scratch[role], act, I, ptrs[l].down, ptrs[l].down_format, nullptr, j0, j1, pout[l % 2][1], H);
      },
  };

  // Every role passes every barrier, even after a stage of its threw (the first error is
  // rethrown once the region ends): a role that left early would hold the others forever.
  RoleBarrier barrier(roles);
  std::atomic<bool> failed{false};
  std::exception_ptr failure;
  constexpr int64_t count = sizeof(stages) / sizeof(stages[0]);
  at::parallel_for(0, roles, 1, [&](int64_t r0, int64_t r1) {
    c10::InferenceMode guard;  // (the attention's GEMMs wrap scratch buffers as tensors)
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t k = 0; k < count; ++k) {
        if (unmerged && k == kMerge) continue;
        try {
          for (int64_t role = r0; role < r1 && !failed.load(std::memory_order_relaxed); ++role) stages[k](l, role);
        } catch (...) {
          if (!failed.exchange(true)) failure = std::current_exception();
        }
        if (l + 1 < L || k + 1 < count) barrier.arrive_and_wait(r1 - r0);
      }
    }
  });
  if (failure) std::rethrow_exception(failure);
  return {outputs[(L - 1) % 2][0], outputs[(L - 1) % 2][1]};
}

// Whether rows of T tokens run as one parallel region (fused_decoder_layers) rather than as the ops composed.
bool fused(const DecoderLayerShape& s) {
  const int64_t rows = s.batch * s.tokens;
  return fused_layer_enabled() && rows > 0 && rows <= kLinearStreamRows && s.tokens <= kFixedSplitTreeLen;
}

// fused_decoder_layers for float32 rows, weights of weight_t, in the cache's dtype.
template <typename weight_t>
std::tuple<at::Tensor, at::Tensor> run_fused_float(const DecoderLayerShape& s, const at::Tensor& delta,
                                                   const std::optional<at::Tensor>& residual,
                                                   const std::vector<LayerTensors>& layers, const at::Tensor& cos,
                                                   const at::Tensor& sin, const at::Tensor& lengths,
                                                   const at::Tensor& tree_mask, double eps) {
  if (layers[0].kv_cache.scalar_type() == at::kBFloat16)  // a bf16 cache (check_cache_dtype)
    return fused_decoder_layers<float, weight_t, c10::BFloat16>(s, delta, residual, layers, cos, sin, lengths,
                                                                tree_mask, eps);
  return fused_decoder_layers<float, weight_t, float>(s, delta, residual, layers, cos, sin, lengths, tree_mask, eps);
}

// fused_decoder_layers in the layers' dtypes.
std::tuple<at::Tensor, at::Tensor> run_fused(const DecoderLayerShape& s, const at::Tensor& delta,
                                             const std::optional<at::Tensor>& residual,
                                             const std::vector<LayerTensors>& layers, const at::Tensor& cos,
                                             const at::Tensor& sin, const at::Tensor& lengths,
                                             const at::Tensor& tree_mask, double eps) {
  if (delta.scalar_type() == at::kFloat) {
    const auto w = layers[0].qkv_weight.scalar_type();
    if (w == at::kByte)  // packed quantized weights
      return run_fused_float<uint8_t>(s, delta, residual, layers, cos, sin, lengths, tree_mask, eps);
    if (w == at::kBFloat16)  // bf16 weights (check_weight_dtype)
      return run_fused_float<c10::BFloat16>(s, delta, residual, layers, cos, sin, lengths, tree_mask, eps);
    return run_fused_float<float>(s, delta, residual, layers, cos, sin, lengths, tree_mask, eps);
  }
  std::tuple<at::Tensor, at::Tensor> result;
  JAKIRO_DISPATCH_FLOAT_BF16(delta.scalar_type(), "decoder_layer_cpu", [&] {
    result = fused_decoder_layers<scalar_t>(s, delta, residual, layers, cos, sin, lengths, tree_mask, eps);
  });
  return result;
}

std::tuple<at::Tensor, at::Tensor> decoder_layer_cpu(
    const at::Tensor& delta, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& lengths, const at::Tensor& tree_mask,
    double eps) {
  const auto s = check_decoder_layer(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                                     gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps,
                                     CpuOps::kBf16Weights, CpuOps::kBf16Cache);
  if (fused(s)) {
    return run_fused(s, delta, residual,
                     {{input_norm, qkv_weight, qkv_bias, o_weight, post_norm, gate_up_weight, down_weight, kv_cache}},
                     cos, sin, lengths, tree_mask, eps);
  }
  return compose_decoder_layer(CpuOps{}, delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                               gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps);
}

// A model's layers in one call: where a layer would be fused, every layer in one parallel region
// (no return to Python, no new region, no new outputs between them); else decoder_layer each.
std::tuple<at::Tensor, at::Tensor> decoder_layers_cpu(
    const at::Tensor& delta, const std::optional<at::Tensor>& residual, at::TensorList input_norms,
    at::TensorList qkv_weights, at::TensorList qkv_biases, at::TensorList o_weights, at::TensorList post_norms,
    at::TensorList gate_up_weights, at::TensorList down_weights, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& kv_cache, const at::Tensor& lengths, const at::Tensor& tree_mask, double eps) {
  const auto s = check_decoder_layers(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms,
                                      gate_up_weights, down_weights, cos, sin, kv_cache, lengths, tree_mask, eps,
                                      CpuOps::kBf16Weights, CpuOps::kBf16Cache);
  if (!fused(s)) {
    return compose_decoder_layers(&decoder_layer_cpu, delta, residual, input_norms, qkv_weights, qkv_biases, o_weights,
                                  post_norms, gate_up_weights, down_weights, cos, sin, kv_cache, lengths, tree_mask,
                                  eps);
  }
  std::vector<LayerTensors> layers;
  layers.reserve(input_norms.size());
  for (size_t l = 0; l < input_norms.size(); ++l) {
    layers.push_back({input_norms[l], qkv_weights[l],
                      qkv_biases.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_biases[l]), o_weights[l],
                      post_norms[l], gate_up_weights[l], down_weights[l], kv_cache.select(0, static_cast<int64_t>(l))});
  }
  return run_fused(s, delta, residual, layers, cos, sin, lengths, tree_mask, eps);
}

}  // namespace

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  check_silu_mul(gate_up);
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(1, 2 * I);
  auto shape = gate_up.sizes().vec();
  shape.back() = I;
  auto x = gate_up.contiguous();
  auto out = at::empty(shape, x.options());
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "silu_mul_cpu", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kSiluRowsPerTask, [&](int64_t r0, int64_t r1) {
      std::vector<float> scratch;
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(px + r * 2 * I, px + r * 2 * I + I, I, po + r * I, scratch);
    });
  });
  return out;
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) {
  m.impl("decoder_layer", &decoder_layer_cpu);
  m.impl("decoder_layers", &decoder_layers_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
}

}  // namespace jakiro::cpu
