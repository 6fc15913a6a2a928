// CPU kernels of jakiro::decoder_layer (a Llama decoder layer in one call) and jakiro::silu_mul
// (the SwiGLU activation of the fused [gate | up] projection in one pass).
//
// A layer of a few rows (decoding, a draft or verification tree: at most kLinearStreamRows
// tokens, or WeightStream::fused_layer_rows where a CPU kind measured fewer) runs as one
// parallel region: every thread takes a share of every stage (a block of each projection's
// output columns, of the RoPE heads, of the attention's split-KV tasks and of the merged
// rows), the stages separated by barriers, and each thread computes the norms of all
// rows for itself (a row of H values: cheaper than a barrier). Composed of the ops instead, the
// layer is seven parallel regions with the small stages on one thread between them, run cold
// after each projection's weight stream, and ~15 allocations. Every value comes from the row
// kernels the ops use (cpu/layer_rows.h, cpu/linear.h, cpu/tree_attention.h), so both forms give
// the same bits (tests/ops/test_decoder_layer.py). Longer inputs (a prompt's chunk) and
// JAKIRO_CPU_FUSED_LAYER=0 compose the ops (csrc/decoder_layer.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/layer_rows.h"
#include "cpu/linear.h"
#include "cpu/merge_attention_states.h"
#include "cpu/skinny_avx512.h"
#include "cpu/tree_attention.h"
#include "decoder_layer.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

constexpr int64_t kSiluRowsPerTask = 8;

struct CpuOps {
  static constexpr bool kBf16Weights = true;
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
      if (spins < 4096)
        ++spins;
      else
        std::this_thread::yield();  // (more threads than free cores)
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

// What one role keeps for itself across the stages, reused from call to call: once the largest
// shape has been seen, nothing is allocated for a layer but its two outputs.
struct RoleScratch {
  std::vector<char> normed;    // the norm of every row (h, then h2): [M, H] scalar_t
  std::vector<char> sums;      // the residual sums of the rows other roles write: [M, H] scalar_t
  std::vector<char> gate_up;   // this role's gate and up columns: 2 x [M, n] scalar_t
  std::vector<float> widened;  // a stage's input rows widened to float32 (bf16 without dot products)
  std::vector<float> norm, product, silu, merge;
  SplitScratch attention;
};

template <typename T>
T* as(std::vector<char>& bytes) {
  return reinterpret_cast<T*>(bytes.data());
}

// weight_t: the projections' weights, scalar_t or bf16 beside float32 activations (check_weight_dtype).
template <typename scalar_t, typename weight_t = scalar_t>
std::tuple<at::Tensor, at::Tensor> fused_decoder_layer(
    const DecoderLayerShape& s, const at::Tensor& delta, const std::optional<at::Tensor>& residual,
    const at::Tensor& input_norm, const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o_weight, const at::Tensor& post_norm, const at::Tensor& gate_up_weight,
    const at::Tensor& down_weight, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
    const at::Tensor& lengths, const at::Tensor& tree_mask, double eps) {
  constexpr bool is_float = std::is_same_v<scalar_t, float>;
  const int64_t B = s.batch, T = s.tokens, M = B * T, H = s.hidden, Hq = s.q_heads, Hkv = s.kv_heads,
                D = s.head_dim, I = s.intermediate, QKV = (Hq + 2 * Hkv) * D;
  const auto options = delta.options();
  const auto x = delta.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), lens = lengths.contiguous(),
             mask = tree_mask.contiguous();
  const at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();
  const at::Tensor qkv_b = qkv_bias.has_value() ? qkv_bias->contiguous() : at::Tensor();
  const auto w_qkv = qkv_weight.contiguous(), w_o = o_weight.contiguous(), w_gu = gate_up_weight.contiguous(),
             w_down = down_weight.contiguous(), w_in = input_norm.contiguous(), w_post = post_norm.contiguous();

  // The buffers the stages share, kept by the calling thread from call to call.
  const int64_t n_qkv = M * QKV, n_q = M * Hq * D;
  thread_local std::vector<char> shared;
  shared.resize((n_qkv + 2 * n_q + 2 * M * H + M * I) * sizeof(scalar_t));
  scalar_t* qkv = as<scalar_t>(shared);
  scalar_t *q = qkv + n_qkv, *attn = q + n_q, *o = attn + n_q, *stream = o + M * H, *act = stream + M * H;
  // The cache positions and the mask, checked as rope_kv_write and tree_attention check them.
  check_rope_kv_write(at::from_blob(qkv, {B, T, Hq + 2 * Hkv, D}, options), c, sn, kv_cache, lens);
  const auto k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  const auto attention_shape =
      check_tree_attention("jakiro::tree_attention", at::from_blob(q, {B, T, Hq, D}, options), k_cache, v_cache, lens, mask);
  // The attention's partial results: splits of kMinSplitLen keys over the longest sequence's keys.
  const int64_t splits = fixed_splits(attention_shape.longest_prefix + T), n_partial = M * Hq * splits * D;
  thread_local std::vector<float> partials;
  partials.resize(n_partial + M * Hq * (splits + 1));
  float *out_partial = partials.data(), *lse_partial = out_partial + n_partial, *lse = lse_partial + M * Hq * splits;
  const int64_t* len = lens.data_ptr<int64_t>();

  // Returned: the residual stream after the attention block, and the MLP's output.
  auto stream2 = at::empty({B, T, H}, options), mlp = at::empty({B, T, H}, options);
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
    rs.widened.resize(dot || is_float ? 0 : M * std::max({H, I, Hq * D}));
    rs.norm.resize(H);
    rs.product.resize(is_float ? 0 : M * std::max({QKV, H, I}));
    rs.silu.resize(3 * I);
    rs.merge.resize(D);
    rs.attention.resize(attention_shape.group() * T, D, !is_float);
  }

  const scalar_t *px = x.data_ptr<scalar_t>(), *pres = res.defined() ? res.data_ptr<scalar_t>() : nullptr;
  const scalar_t* pqkv_b = qkv_b.defined() ? qkv_b.data_ptr<scalar_t>() : nullptr;
  const weight_t *wq = w_qkv.data_ptr<weight_t>(), *wo = w_o.data_ptr<weight_t>(), *wgu = w_gu.data_ptr<weight_t>(),
                 *wd = w_down.data_ptr<weight_t>();
  const scalar_t *win = w_in.data_ptr<scalar_t>(), *wpost = w_post.data_ptr<scalar_t>();
  scalar_t *pstream2 = stream2.data_ptr<scalar_t>(), *pmlp = mlp.data_ptr<scalar_t>();
  scalar_t *keys = k_cache.data_ptr<scalar_t>(), *values = v_cache.data_ptr<scalar_t>();
  const int64_t batch_stride = kv_cache.stride(1), head_stride = kv_cache.stride(2);
  const RopeKvWrite<scalar_t> rope{qkv, c.data_ptr<scalar_t>(), sn.data_ptr<scalar_t>(), len, q, keys, values, T, Hq,
                                   Hkv, D, batch_stride, head_stride};
  const PartialArgs attention{attention_shape, splits, kMinSplitLen,
                              attention_scale("jakiro::tree_attention", std::nullopt, D), len,
                              mask.data_ptr<int64_t>(), mask.size(2), out_partial, lse_partial};

  // y[:, j0:j1) = rows @ w[j0:j1)^T (+ bias) for a stage's input rows (M x K, scalar_t).
  auto project = [&](RoleScratch& rs, const scalar_t* rows, int64_t K, const weight_t* w, const scalar_t* bias,
                     int64_t j0, int64_t j1, scalar_t* y, int64_t ldy) {
    if (j0 >= j1) return;
    StreamedRows in;
    if constexpr (is_float) {
      in.f = rows;
    } else if (dot) {
      in.bf16 = rows;
    } else {
      to_float(rows, rs.widened.data(), M * K);
      in.f = rs.widened.data();
    }
    linear_columns<scalar_t, weight_t>(in, M, K, w, bias, j0, j1, y, ldy, rs.product.data());
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
      scalar_t* sum = (m >= own0 && m < own1 ? sums : as<scalar_t>(rs.sums)) + m * H;
      rms_norm_row(xs + m * H, residuals == nullptr ? nullptr : residuals + m * H, weight, H,
                   static_cast<float>(eps), as<scalar_t>(rs.normed) + m * H, sum, rs.norm.data());
    }
  };

  const std::function<void(int64_t)> stages[] = {
      [&](int64_t role) {  // the input norm; the qkv projection's columns
        RoleScratch& rs = role_scratch[role];
        norm_rows(rs, role, px, pres, win, stream);
        const auto [j0, j1] = columns(QKV, role);
        project(rs, as<scalar_t>(rs.normed), H, wq, pqkv_b, j0, j1, qkv, QKV);
      },
      [&](int64_t role) {  // RoPE of q and k and the cache write, by (row, head)
        const int64_t per_row = rope.units_per_row();
        const auto [u0, u1] = share(M * per_row, role, roles);
        for (int64_t u = u0; u < u1; ++u) rope.unit(u / per_row, u % per_row);
      },
      [&](int64_t role) {  // the attention's split-KV tasks
        const auto [t0, t1] = share(B * Hkv * splits, role, roles);
        for (int64_t task = t0; task < t1; ++task) {
          const int64_t split = task % splits, kvh = (task / splits) % Hkv, b = task / (splits * Hkv);
          attend_one_split(attention, q, keys, values, batch_stride, head_stride, b, kvh, split, 0, T,
                           role_scratch[role].attention);
        }
      },
      [&](int64_t role) {  // their merge, by (row, head)
        const auto [r0, r1] = share(M * Hq, role, roles);
        for (int64_t row = r0; row < r1; ++row) {
          merge_attention_row(out_partial + row * splits * D, lse_partial + row * splits, splits, D,
                              role_scratch[role].merge.data(), attn + row * D, lse + row);
        }
      },
      [&](int64_t role) {  // the output projection's columns
        const auto [j0, j1] = columns(H, role);
        project(role_scratch[role], attn, Hq * D, wo, nullptr, j0, j1, o, H);
      },
      [&](int64_t role) {  // the post-attention norm; the role's gate and up columns, their SiLU product
        RoleScratch& rs = role_scratch[role];
        norm_rows(rs, role, o, stream, wpost, pstream2);
        const auto [a, b] = columns(I, role);
        const int64_t n = b - a;
        scalar_t *gate = as<scalar_t>(rs.gate_up), *up = gate + M * n;
        project(rs, as<scalar_t>(rs.normed), H, wgu + a * H, nullptr, 0, n, gate, n);
        project(rs, as<scalar_t>(rs.normed), H, wgu + (I + a) * H, nullptr, 0, n, up, n);
        for (int64_t m = 0; m < M && n > 0; ++m) silu_mul_row(gate + m * n, up + m * n, n, act + m * I + a, rs.silu);
      },
      [&](int64_t role) {  // the down projection's columns
        const auto [j0, j1] = columns(H, role);
        project(role_scratch[role], act, I, wd, nullptr, j0, j1, pmlp, H);
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
    for (int64_t k = 0; k < count; ++k) {
      try {
        for (int64_t role = r0; role < r1 && !failed.load(std::memory_order_relaxed); ++role) stages[k](role);
      } catch (...) {
        if (!failed.exchange(true)) failure = std::current_exception();
      }
      if (k + 1 < count) barrier.arrive_and_wait(r1 - r0);
    }
  });
  if (failure) std::rethrow_exception(failure);
  return {stream2, mlp};
}

std::tuple<at::Tensor, at::Tensor> decoder_layer_cpu(
    const at::Tensor& delta, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& lengths, const at::Tensor& tree_mask,
    double eps) {
  const auto s = check_decoder_layer(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                                     gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps,
                                     CpuOps::kBf16Weights);
  const int64_t rows = s.batch * s.tokens;
  if (fused_layer_enabled() && rows > 0 && rows <= std::min(kLinearStreamRows, weight_stream().fused_layer_rows) &&
      s.tokens <= kFixedSplitTreeLen) {
    std::tuple<at::Tensor, at::Tensor> result;
    if (qkv_weight.scalar_type() != delta.scalar_type())  // float32 rows, bf16 weights (check_weight_dtype)
      return fused_decoder_layer<float, c10::BFloat16>(s, delta, residual, input_norm, qkv_weight, qkv_bias, o_weight,
                                                       post_norm, gate_up_weight, down_weight, cos, sin, kv_cache,
                                                       lengths, tree_mask, eps);
    JAKIRO_DISPATCH_FLOAT_BF16(delta.scalar_type(), "decoder_layer_cpu", [&] {
      result = fused_decoder_layer<scalar_t>(s, delta, residual, input_norm, qkv_weight, qkv_bias, o_weight,
                                             post_norm, gate_up_weight, down_weight, cos, sin, kv_cache, lengths,
                                             tree_mask, eps);
    });
    return result;
  }
  return compose_decoder_layer(CpuOps{}, delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                               gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps);
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
  m.impl("silu_mul", &silu_mul_cpu);
}

}  // namespace jakiro::cpu
