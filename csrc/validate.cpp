#include "ops.h"

#include <algorithm>
#include <cmath>

#include "checks.h"
#include "jakiro/common.h"

namespace jakiro {

namespace {

// Value checks need the data on the host. On the GPU they would cost a device-to-host copy
// and a sync per call, so there the kernels check their index values and report a bad one to
// the device's error word (jakiro::device_errors) instead. The emulated GPU build does as the GPU.
bool host_readable([[maybe_unused]] const at::Tensor& t) {
#if defined(SIMT_EMU)
  return false;
#else
  return t.device().is_cpu();
#endif
}

void check_lengths(const char* op, const char* name, const at::Tensor& t, int64_t batch) {
  check_dim(op, name, t, 1, "[B]");
  check_dtype(op, name, t, {at::kLong});
  check_size(op, name, t, 0, batch, "batch");
}

}  // namespace

TreeAttentionShape check_tree_attention(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                        const at::Tensor& tree_mask, bool bf16_cache) {
  check_dim(op, "q", q, 4, "[B, T, Hq, D]");
  check_dim(op, "k_cache", k_cache, 4, "[B, Hkv, S, D]");
  check_dim(op, "v_cache", v_cache, 4, "[B, Hkv, S, D]");
  check_dtype(op, "q", q, {at::kFloat, at::kBFloat16});
  check_cache_dtype(op, "k_cache", k_cache, "q", q, bf16_cache);
  check_same_dtype(op, "v_cache", v_cache, "k_cache", k_cache);
  for (auto* t : {&k_cache, &v_cache, &prefix_lens, &tree_mask}) check_same_device(op, "every tensor", *t, q);

  TreeAttentionShape s{q.size(0), q.size(1), q.size(2), k_cache.size(1), q.size(3), k_cache.size(2)};
  TORCH_CHECK(s.tree_len >= 1, op, ": q must hold at least one tree token (q.shape[1] >= 1), got shape ", q.sizes());
  TORCH_CHECK(s.head_dim >= 1, op, ": head dim must be >= 1, got q.shape ", q.sizes());
  check_size(op, "k_cache", k_cache, 0, s.batch, "batch, as q.shape[0]");
  check_size(op, "k_cache", k_cache, 3, s.head_dim, "head dim, as q.shape[3]");
  TORCH_CHECK(s.kv_heads >= 1 && s.q_heads % s.kv_heads == 0, op,
              ": query heads must be a multiple of KV heads (GQA), got q heads ", s.q_heads, " (q.shape[2]) and KV heads ",
              s.kv_heads, " (k_cache.shape[1])");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have the shape of k_cache ", k_cache.sizes(),
              ", got ", v_cache.sizes());
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), op, ": v_cache must have the strides of k_cache ",
              k_cache.strides(), ", got ", v_cache.strides());
  for (auto [name, t] : {std::pair{"k_cache", &k_cache}, std::pair{"v_cache", &v_cache}}) {
    TORCH_CHECK(t->stride(3) == 1 && t->stride(2) == s.head_dim, op, ": ", name,
                " must have contiguous [S, D] rows per (batch, head) (strides [..., ..., D, 1] = [..., ..., ", s.head_dim,
                ", 1]), got strides ", t->strides());
  }
  check_lengths(op, "prefix_lens", prefix_lens, s.batch);
  check_dim(op, "tree_mask", tree_mask, 3, "[B, T, ceil(T/64)]");
  check_dtype(op, "tree_mask", tree_mask, {at::kLong});
  check_size(op, "tree_mask", tree_mask, 0, s.batch, "batch");
  check_size(op, "tree_mask", tree_mask, 1, s.tree_len, "tree tokens, as q.shape[1]");
  TORCH_CHECK(tree_mask.size(2) >= mask_words(s.tree_len), op, ": tree_mask is too short: ", s.tree_len,
              " tree tokens need ", mask_words(s.tree_len), " int64 words per row (tree_mask.shape[2]), got ",
              tree_mask.size(2));
  if (host_readable(prefix_lens)) {
    auto lens = prefix_lens.contiguous();
    const int64_t* p = lens.data_ptr<int64_t>();
    s.longest_prefix = 0;
    for (int64_t b = 0; b < s.batch; ++b) {
      TORCH_CHECK(p[b] >= 0 && p[b] <= s.capacity - s.tree_len, op, ": prefix_lens[", b, "] + tree tokens = ", p[b],
                  " + ", s.tree_len, " must be within [0, cache capacity ", s.capacity, " (k_cache.shape[2])]");
      s.longest_prefix = std::max(s.longest_prefix, p[b]);
    }
  }
  return s;
}

float attention_scale(const char* op, std::optional<double> scale, int64_t head_dim) {
  const double value = scale.value_or(1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(1, head_dim))));
  TORCH_CHECK(std::isfinite(static_cast<float>(value)), op, ": scale must be a finite float32 number (default 1 / sqrt(",
              "head dim)), got ", value);
  return static_cast<float>(value);
}

at::ScalarType check_merge_attention_states(const at::Tensor& out_partial, const at::Tensor& lse_partial,
                                            std::optional<at::ScalarType> out_dtype) {
  const char* op = "jakiro::merge_attention_states";
  check_dim(op, "out_partial", out_partial, 5, "[B, T, H, splits, D]");
  check_dim(op, "lse_partial", lse_partial, 4, "[B, T, H, splits]");
  check_dtype(op, "out_partial", out_partial, {at::kFloat});
  check_dtype(op, "lse_partial", lse_partial, {at::kFloat});
  check_same_device(op, "lse_partial", lse_partial, out_partial);
  TORCH_CHECK(lse_partial.sizes() == out_partial.sizes().slice(0, 4), op,
              ": lse_partial must have shape out_partial.shape[:4] = ", out_partial.sizes().slice(0, 4), ", got ",
              lse_partial.sizes());
  TORCH_CHECK(out_partial.size(3) >= 1, op, ": there must be at least one split, got out_partial shape ",
              out_partial.sizes());
  TORCH_CHECK(out_partial.size(4) >= 1, op, ": the head dim (out_partial.shape[4]) must be >= 1, got shape ",
              out_partial.sizes());
  const auto dtype = out_dtype.value_or(at::kFloat);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": out_dtype must be float32 or bfloat16, got ", dtype);
  return dtype;
}

MoeShape check_moe_top2(const at::Tensor& x, const at::Tensor& router_weight, const at::Tensor& w_gate,
                        const at::Tensor& w_up, const at::Tensor& w_down, bool bf16_weights) {
  const char* op = "jakiro::moe_top2";
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must have shape [..., H] with H >= 1, got ", x.sizes());
  check_dtype(op, "x", x, {at::kFloat, at::kBFloat16});
  check_dim(op, "router_weight", router_weight, 2, "[N + 2, H]");
  check_dim(op, "w_gate", w_gate, 3, "[N, I, H]");
  check_dim(op, "w_up", w_up, 3, "[N, I, H]");
  check_dim(op, "w_down", w_down, 3, "[N, H, I]");
  check_same_dtype(op, "router_weight", router_weight, "x", x);
  check_same_device(op, "router_weight", router_weight, x);
  for (auto [name, t] : {std::pair{"w_gate", &w_gate}, std::pair{"w_up", &w_up}, std::pair{"w_down", &w_down}}) {
    check_weight_dtype(op, name, *t, "x", x, bf16_weights);
    check_same_dtype(op, name, *t, "w_gate", w_gate);
    check_same_device(op, name, *t, x);
  }
  MoeShape s{x.numel() / std::max<int64_t>(1, x.size(-1)), x.size(-1), w_gate.size(0), w_gate.size(1)};
  TORCH_CHECK(s.experts >= 2 && s.experts <= 8, op, ": the number of experts N (w_gate.shape[0]) must be in [2, 8], got ",
              s.experts);
  check_size(op, "w_gate", w_gate, 2, s.hidden, "hidden size, as x.shape[-1]");
  TORCH_CHECK(w_up.sizes() == w_gate.sizes(), op, ": w_up must have the shape of w_gate ", w_gate.sizes(), ", got ",
              w_up.sizes());
  TORCH_CHECK(w_down.size(0) == s.experts && w_down.size(1) == s.hidden && w_down.size(2) == s.intermediate, op,
              ": w_down must have shape [N, H, I] = [", s.experts, ", ", s.hidden, ", ", s.intermediate, "], got ",
              w_down.sizes());
  TORCH_CHECK(router_weight.size(0) == s.experts + 2 && router_weight.size(1) == s.hidden, op,
              ": router_weight must have shape [N + 2, H] = [", s.experts + 2, ", ", s.hidden,
              "] (N routing logits plus 2 contrastive logits), got ", router_weight.sizes());
  return s;
}

MoeOutputs empty_moe_outputs(const at::Tensor& x) {
  auto with_last = [&](std::initializer_list<int64_t> dims) {
    auto shape = x.sizes().slice(0, x.dim() - 1).vec();
    shape.insert(shape.end(), dims);
    return shape;
  };
  const auto fopts = x.options().dtype(at::kFloat);
  return {at::empty(with_last({2, x.size(-1)}), x.options()), at::empty(with_last({2}), x.options().dtype(at::kLong)),
          at::empty(with_last({2}), fopts), at::empty(with_last({2}), fopts)};
}

void check_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::optional<at::Tensor>& residual) {
  const char* op = "jakiro::rms_norm";
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must have shape [..., H] with H >= 1, got ", x.sizes());
  check_dtype(op, "x", x, {at::kFloat, at::kBFloat16});
  check_dim(op, "weight", weight, 1, "[H]");
  check_same_dtype(op, "weight", weight, "x", x);
  check_same_device(op, "weight", weight, x);
  check_size(op, "weight", weight, 0, x.size(-1), "hidden size H, as x.shape[-1]");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes(), op, ": residual must have the shape of x ", x.sizes(), ", got ",
                residual->sizes());
    check_same_dtype(op, "residual", *residual, "x", x);
    check_same_device(op, "residual", *residual, x);
  }
}

RopeKvShape check_rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& kv_cache, const at::Tensor& lengths, bool bf16_cache) {
  const char* op = "jakiro::rope_kv_write";
  check_dim(op, "qkv", qkv, 4, "[B, T, Hq + 2 Hkv, D]");
  check_dim(op, "kv_cache", kv_cache, 5, "[2, B, Hkv, S, D]");
  check_dtype(op, "qkv", qkv, {at::kFloat, at::kBFloat16});
  for (auto [name, t] : {std::pair{"cos", &cos}, std::pair{"sin", &sin}, std::pair{"kv_cache", &kv_cache}}) {
    if (t == &kv_cache) {
      check_cache_dtype(op, name, *t, "qkv", qkv, bf16_cache);
    } else {
      check_same_dtype(op, name, *t, "qkv", qkv);
    }
    check_same_device(op, name, *t, qkv);
  }
  check_same_device(op, "lengths", lengths, qkv);
  const RopeKvShape s{qkv.size(0), qkv.size(1), qkv.size(2) - 2 * kv_cache.size(2), kv_cache.size(2), qkv.size(3),
                      kv_cache.size(3)};
  TORCH_CHECK(s.head_dim >= 2 && s.head_dim % 2 == 0, op, ": head dim (qkv.shape[3]) must be even and >= 2, got ",
              s.head_dim);
  TORCH_CHECK(s.kv_heads >= 1 && s.q_heads >= 1, op, ": qkv.shape[2] must be Hq + 2 Hkv with Hq >= 1 and Hkv = ",
              "kv_cache.shape[2] >= 1, got qkv.shape[2] = ", qkv.size(2), " and Hkv = ", s.kv_heads);
  check_size(op, "kv_cache", kv_cache, 0, 2, "keys and values");
  check_size(op, "kv_cache", kv_cache, 1, s.batch, "batch, as qkv.shape[0]");
  check_size(op, "kv_cache", kv_cache, 4, s.head_dim, "head dim, as qkv.shape[3]");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == s.head_dim, op,
              ": kv_cache must have contiguous [S, D] rows (strides [..., D, 1]), got strides ", kv_cache.strides());
  const std::vector<int64_t> table{s.batch, s.tokens, s.head_dim};
  for (auto [name, t] : {std::pair{"cos", &cos}, std::pair{"sin", &sin}}) {
    TORCH_CHECK(t->sizes() == at::IntArrayRef(table), op, ": ", name, " must have shape [B, T, D] = ",
                at::IntArrayRef(table), ", got ", t->sizes());
  }
  check_lengths(op, "lengths", lengths, s.batch);
  if (host_readable(lengths)) {
    auto lens = lengths.contiguous();
    const int64_t* p = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < s.batch; ++b) {
      TORCH_CHECK(p[b] >= 0 && p[b] <= s.capacity - s.tokens, op, ": lengths[", b, "] + new tokens = ", p[b], " + ",
                  s.tokens, " must be within [0, cache capacity ", s.capacity, " (kv_cache.shape[3])]");
    }
  }
  return s;
}

DecoderLayerShape check_decoder_layer(const at::Tensor& delta, const std::optional<at::Tensor>& residual,
                                      const at::Tensor& input_norm, const at::Tensor& qkv_weight,
                                      const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
                                      const at::Tensor& post_norm, const at::Tensor& gate_up_weight,
                                      const at::Tensor& down_weight, const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& kv_cache, const at::Tensor& lengths,
                                      const at::Tensor& tree_mask, double eps, bool bf16_weights,
                                      bool bf16_cache) {
  const char* op = "jakiro::decoder_layer";
  check_dim(op, "delta", delta, 3, "[B, T, H]");
  check_dtype(op, "delta", delta, {at::kFloat, at::kBFloat16});
  check_dim(op, "kv_cache", kv_cache, 5, "[2, B, Hkv, S, D]");
  const int64_t B = delta.size(0), T = delta.size(1), H = delta.size(2);
  const int64_t Hkv = kv_cache.size(2), D = kv_cache.size(4);
  TORCH_CHECK(T >= 1 && H >= 1, op, ": delta must hold at least one token of at least one feature, got shape ",
              delta.sizes());
  TORCH_CHECK(Hkv >= 1 && D >= 2 && D % 2 == 0, op, ": kv_cache [2, B, Hkv, S, D] must have Hkv >= 1 and an even ",
              "D >= 2, got shape ", kv_cache.sizes());
  const auto [o_rows, o_cols] = check_weight_matrix(op, "o_weight", o_weight, "[H, Hq D]", "delta", delta, bf16_weights);
  const int64_t Hq = o_cols / D;
  TORCH_CHECK(o_cols % D == 0 && Hq >= 1 && Hq % Hkv == 0, op, ": o_weight.shape[1] must be Hq * D with ",
              "D = ", D, " (kv_cache.shape[4]) and Hq a multiple of Hkv = ", Hkv, ", got ", o_cols);
  const auto [qkv_rows, qkv_cols] =
      check_weight_matrix(op, "qkv_weight", qkv_weight, "[(Hq + 2 Hkv) D, H]", "delta", delta, bf16_weights);
  const auto [gate_up_rows, gate_up_cols] =
      check_weight_matrix(op, "gate_up_weight", gate_up_weight, "[2 I, H]", "delta", delta, bf16_weights);
  const auto [down_rows, I] = check_weight_matrix(op, "down_weight", down_weight, "[H, I]", "delta", delta, bf16_weights);
  check_dim(op, "input_norm", input_norm, 1, "[H]");
  check_dim(op, "post_norm", post_norm, 1, "[H]");
  TORCH_CHECK(I >= 1, op, ": down_weight [H, I] must have I >= 1, got shape ", down_weight.sizes());
  check_weight_size(op, "qkv_weight", qkv_weight, 0, qkv_rows, (Hq + 2 * Hkv) * D, "(Hq + 2 Hkv) D");
  check_weight_size(op, "qkv_weight", qkv_weight, 1, qkv_cols, H, "hidden size H, as delta.shape[2]");
  check_weight_size(op, "o_weight", o_weight, 0, o_rows, H, "hidden size H, as delta.shape[2]");
  check_weight_size(op, "gate_up_weight", gate_up_weight, 0, gate_up_rows, 2 * I, "2 I, I = down_weight.shape[1]");
  check_weight_size(op, "gate_up_weight", gate_up_weight, 1, gate_up_cols, H, "hidden size H, as delta.shape[2]");
  check_weight_size(op, "down_weight", down_weight, 0, down_rows, H, "hidden size H, as delta.shape[2]");
  check_size(op, "input_norm", input_norm, 0, H, "hidden size H, as delta.shape[2]");
  check_size(op, "post_norm", post_norm, 0, H, "hidden size H, as delta.shape[2]");
  check_size(op, "kv_cache", kv_cache, 0, 2, "keys and values");
  check_size(op, "kv_cache", kv_cache, 1, B, "batch, as delta.shape[0]");
  if (qkv_bias.has_value()) {
    check_dim(op, "qkv_bias", *qkv_bias, 1, "[(Hq + 2 Hkv) D]");
    check_size(op, "qkv_bias", *qkv_bias, 0, (Hq + 2 * Hkv) * D, "(Hq + 2 Hkv) D");
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == delta.sizes(), op, ": residual must have the shape of delta ", delta.sizes(),
                ", got ", residual->sizes());
  }
  const std::vector<int64_t> table{B, T, D};
  for (auto [name, t] : {std::pair{"cos", &cos}, std::pair{"sin", &sin}}) {
    TORCH_CHECK(t->sizes() == at::IntArrayRef(table), op, ": ", name, " must have shape [B, T, D] = ",
                at::IntArrayRef(table), ", got ", t->sizes());
  }
  const std::pair<const char*, const at::Tensor*> floats[] = {
      {"input_norm", &input_norm}, {"post_norm", &post_norm}, {"cos", &cos}, {"sin", &sin}};
  for (const auto& [name, t] : floats) {
    check_same_dtype(op, name, *t, "delta", delta);
    check_same_device(op, name, *t, delta);
  }
  check_cache_dtype(op, "kv_cache", kv_cache, "delta", delta, bf16_cache);
  check_same_device(op, "kv_cache", kv_cache, delta);
  const std::pair<const char*, const at::Tensor*> weights[] = {
      {"qkv_weight", &qkv_weight}, {"o_weight", &o_weight}, {"gate_up_weight", &gate_up_weight},
      {"down_weight", &down_weight}};
  for (const auto& [name, t] : weights) {
    if (t->scalar_type() != at::kByte) check_weight_dtype(op, name, *t, "delta", delta, bf16_weights);
    check_same_device(op, name, *t, delta);
  }
  TORCH_CHECK(qkv_weight.scalar_type() == o_weight.scalar_type() && o_weight.scalar_type() == gate_up_weight.scalar_type() &&
                  gate_up_weight.scalar_type() == down_weight.scalar_type(),
              op, ": the four projection weights must share one dtype, got qkv ", qkv_weight.scalar_type(), ", o ",
              o_weight.scalar_type(), ", gate_up ", gate_up_weight.scalar_type(), ", down ", down_weight.scalar_type());
  for (auto [name, t] : {std::pair{"residual", &residual}, std::pair{"qkv_bias", &qkv_bias}}) {
    if (t->has_value()) {
      check_same_dtype(op, name, **t, "delta", delta);
      check_same_device(op, name, **t, delta);
    }
  }
  check_same_device(op, "lengths", lengths, delta);
  check_same_device(op, "tree_mask", tree_mask, delta);
  check_lengths(op, "lengths", lengths, B);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  return {B, T, H, Hq, Hkv, D, I};
}

DecoderLayerShape check_decoder_layers(const at::Tensor& delta, const std::optional<at::Tensor>& residual,
                                       at::TensorList input_norms, at::TensorList qkv_weights,
                                       at::TensorList qkv_biases, at::TensorList o_weights, at::TensorList post_norms,
                                       at::TensorList gate_up_weights, at::TensorList down_weights,
                                       const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                                       const at::Tensor& lengths, const at::Tensor& tree_mask, double eps,
                                       bool bf16_weights, bool bf16_cache) {
  const char* op = "jakiro::decoder_layers";
  const int64_t L = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(L >= 1, op, ": input_norms must hold at least one layer's weight, got none");
  const std::pair<const char*, at::TensorList> lists[] = {
      {"qkv_weights", qkv_weights}, {"o_weights", o_weights}, {"post_norms", post_norms},
      {"gate_up_weights", gate_up_weights}, {"down_weights", down_weights}};
  for (const auto& [name, list] : lists) {
    TORCH_CHECK(static_cast<int64_t>(list.size()) == L, op, ": ", name, " must hold one tensor per layer, ", L,
                " as input_norms, got ", list.size());
  }
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == L, op,
              ": qkv_biases must hold one tensor per layer, ", L, " as input_norms, or none, got ", qkv_biases.size());
  check_dim(op, "kv_cache", kv_cache, 6, "[L, 2, B, Hkv, S, D]");
  check_size(op, "kv_cache", kv_cache, 0, L, "layers, as len(input_norms)");
  DecoderLayerShape first{};
  for (int64_t l = 0; l < L; ++l) {
    DecoderLayerShape s{};
    try {
      s = check_decoder_layer(delta, residual, input_norms[l], qkv_weights[l],
                              qkv_biases.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_biases[l]),
                              o_weights[l], post_norms[l], gate_up_weights[l], down_weights[l], cos, sin,
                              kv_cache.select(0, l), lengths, tree_mask, eps, bf16_weights, bf16_cache);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, op, ": layer ", l, ": ", e.msg());
    }
    if (l == 0) first = s;
    TORCH_CHECK(s.intermediate == first.intermediate && qkv_weights[l].scalar_type() == qkv_weights[0].scalar_type(),
                op, ": every layer must have layer 0's MLP width ", first.intermediate, " and weight dtype ",
                qkv_weights[0].scalar_type(), ", layer ", l, " has ", s.intermediate, " and ",
                qkv_weights[l].scalar_type());
  }
  return first;
}

void check_silu_mul(const at::Tensor& gate_up) {
  const char* op = "jakiro::silu_mul";
  check_dtype(op, "gate_up", gate_up, {at::kFloat, at::kBFloat16});
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) >= 2 && gate_up.size(-1) % 2 == 0, op,
              ": gate_up must have shape [..., 2 I] with I >= 1 ([gate | up]), got ", gate_up.sizes());
}

void check_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  bool bf16_weights) {
  const char* op = "jakiro::linear";
  TORCH_CHECK(x.dim() >= 1, op, ": x must have shape [..., K], got a 0-dimensional tensor");
  check_dtype(op, "x", x, {at::kFloat, at::kBFloat16});
  const auto [N, K] = check_weight_matrix(op, "weight", weight, "[N, K]", "x", x, bf16_weights);
  if (weight.scalar_type() != at::kByte) check_weight_dtype(op, "weight", weight, "x", x, bf16_weights);
  check_same_device(op, "weight", weight, x);
  check_weight_size(op, "weight", weight, 1, K, x.size(-1), "in features K, as x.shape[-1]");
  if (bias.has_value()) {
    check_dim(op, "bias", *bias, 1, "[N]");
    check_same_dtype(op, "bias", *bias, "x", x);
    check_same_device(op, "bias", *bias, x);
    check_size(op, "bias", *bias, 0, N, "out features N, as weight's rows");
  }
}

MlpHeadsShape check_mlp_heads(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& b_in,
                              const at::Tensor& w_blocks, const at::Tensor& b_blocks) {
  const char* op = "jakiro::mlp_heads";
  TORCH_CHECK(x.dim() >= 1, op, ": x must have shape [..., K], got a 0-dimensional tensor");
  check_dtype(op, "x", x, {at::kFloat, at::kBFloat16});
  check_dim(op, "w_in", w_in, 3, "[J, H, K]");
  check_dim(op, "b_in", b_in, 2, "[J, H]");
  check_dim(op, "w_blocks", w_blocks, 4, "[J, NB, H, H]");
  check_dim(op, "b_blocks", b_blocks, 3, "[J, NB, H]");
  const std::pair<const char*, const at::Tensor*> weights[] = {
      {"w_in", &w_in}, {"b_in", &b_in}, {"w_blocks", &w_blocks}, {"b_blocks", &b_blocks}};
  for (const auto& [name, t] : weights) {
    check_same_dtype(op, name, *t, "x", x);
    check_same_device(op, name, *t, x);
  }
  const int64_t J = w_in.size(0), H = w_in.size(1), NB = w_blocks.size(1);
  check_size(op, "w_in", w_in, 2, x.size(-1), "in features K, as x.shape[-1]");
  check_size(op, "b_in", b_in, 0, J, "heads J, as w_in.shape[0]");
  check_size(op, "b_in", b_in, 1, H, "hidden H, as w_in.shape[1]");
  check_size(op, "w_blocks", w_blocks, 0, J, "heads J, as w_in.shape[0]");
  check_size(op, "w_blocks", w_blocks, 2, H, "hidden H, as w_in.shape[1]");
  check_size(op, "w_blocks", w_blocks, 3, H, "hidden H, as w_in.shape[1]");
  check_size(op, "b_blocks", b_blocks, 0, J, "heads J, as w_in.shape[0]");
  check_size(op, "b_blocks", b_blocks, 1, NB, "blocks NB, as w_blocks.shape[1]");
  check_size(op, "b_blocks", b_blocks, 2, H, "hidden H, as w_in.shape[1]");
  int64_t rows = 1;  // the product of the leading dims (also when K = 0)
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return {rows, x.size(-1), J, H, NB};
}

void check_contrastive_topk(const at::Tensor& h_a, const std::optional<at::Tensor>& h_b,
                            const std::optional<at::Tensor>& contrast_weight, const at::Tensor& lm_head, int64_t k,
                            bool bf16_weights) {
  const char* op = "jakiro::contrastive_topk";
  TORCH_CHECK(h_a.dim() >= 1 && h_a.size(-1) >= 1, op, ": h_a must have shape [..., H] with H >= 1, got ",
              h_a.sizes());
  check_dtype(op, "h_a", h_a, {at::kFloat, at::kBFloat16});
  const auto [V, H] = check_weight_matrix(op, "lm_head", lm_head, "[V, H]", "h_a", h_a, bf16_weights);
  if (lm_head.scalar_type() != at::kByte) check_weight_dtype(op, "lm_head", lm_head, "h_a", h_a, bf16_weights);
  check_same_device(op, "lm_head", lm_head, h_a);
  check_weight_size(op, "lm_head", lm_head, 1, H, h_a.size(-1), "hidden size, as h_a.shape[-1]");
  TORCH_CHECK(h_b.has_value() == contrast_weight.has_value(), op,
              ": h_b and contrast_weight go together (both for the contrastive feature, neither for the plain one), got ",
              h_b.has_value() ? "h_b" : "no h_b", " and ", contrast_weight.has_value() ? "contrast_weight" : "no contrast_weight");
  if (h_b.has_value()) {
    TORCH_CHECK(h_b->sizes() == h_a.sizes(), op, ": h_b must have the shape of h_a ", h_a.sizes(), ", got ", h_b->sizes());
    check_same_dtype(op, "h_b", *h_b, "h_a", h_a);
    check_same_device(op, "h_b", *h_b, h_a);
    auto expected = h_a.sizes().vec();
    expected.back() = 2;
    TORCH_CHECK(contrast_weight->sizes() == at::IntArrayRef(expected), op,
                ": contrast_weight must have shape h_a.shape[:-1] + (2,) = ", at::IntArrayRef(expected), ", got ",
                contrast_weight->sizes());
    check_dtype(op, "contrast_weight", *contrast_weight, {at::kFloat, at::kBFloat16});
    check_same_device(op, "contrast_weight", *contrast_weight, h_a);
  }
  TORCH_CHECK(k >= 1 && k <= V, op, ": k must be in [1, vocab size ", V, "], got ", k);
}

void check_verify_tree(const at::Tensor& parents, const at::Tensor& draft_tokens, const at::Tensor& target_logits,
                       const std::optional<at::Tensor>& uniforms, double temperature, double top_p, int64_t top_k) {
  const char* op = "jakiro::verify_tree";
  check_dim(op, "parents", parents, 2, "[B, T]");
  check_dtype(op, "parents", parents, {at::kLong});
  check_dim(op, "draft_tokens", draft_tokens, 2, "[B, T]");
  check_dtype(op, "draft_tokens", draft_tokens, {at::kLong});
  check_dim(op, "target_logits", target_logits, 3, "[B, T, V]");
  check_dtype(op, "target_logits", target_logits, {at::kFloat, at::kBFloat16});
  for (auto* t : {&draft_tokens, &target_logits}) check_same_device(op, "every tensor", *t, parents);
  const int64_t batch = parents.size(0), nodes = parents.size(1), vocab = target_logits.size(2);
  TORCH_CHECK(nodes >= 1, op, ": the tree must have at least its root (parents.shape[1] >= 1), got ", parents.sizes());
  TORCH_CHECK(draft_tokens.sizes() == parents.sizes(), op, ": draft_tokens must have the shape of parents ",
              parents.sizes(), ", got ", draft_tokens.sizes());
  TORCH_CHECK(target_logits.size(0) == batch && target_logits.size(1) == nodes, op,
              ": target_logits must have shape [B, T, V] with [B, T] = ", parents.sizes(), ", got ", target_logits.sizes());
  TORCH_CHECK(vocab >= 1, op, ": target_logits must have a vocabulary dimension >= 1, got ", target_logits.sizes());
  TORCH_CHECK(temperature >= 0.0 && std::isfinite(temperature), op, ": temperature must be finite and >= 0, got ",
              temperature);
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, op, ": top_p must be in (0, 1], got ", top_p);
  TORCH_CHECK(top_k >= 0, op, ": top_k must be >= 0 (0 disables it), got ", top_k);
  if (temperature > 0.0) {
    TORCH_CHECK(uniforms.has_value(), op, ": sampling (temperature ", temperature,
                " > 0) needs uniforms [B, T + 1] float64 random draws in [0, 1), got none");
    check_dim(op, "uniforms", *uniforms, 2, "[B, T + 1]");
    check_dtype(op, "uniforms", *uniforms, {at::kDouble});
    check_same_device(op, "uniforms", *uniforms, parents);
    TORCH_CHECK(uniforms->size(0) == batch && uniforms->size(1) == nodes + 1, op, ": uniforms must have shape [B, T + 1] = [",
                batch, ", ", nodes + 1, "], got ", uniforms->sizes());
    if (host_readable(*uniforms)) {
      auto u = uniforms->contiguous();
      const double* pu = u.data_ptr<double>();
      for (int64_t i = 0; i < u.numel(); ++i) {
        TORCH_CHECK(pu[i] >= 0.0 && pu[i] < 1.0, op, ": uniforms must be in [0, 1), got ", pu[i], " at flat index ", i);
      }
    }
  }
  if (host_readable(parents)) {
    auto par = parents.contiguous();
    auto tok = draft_tokens.contiguous();
    const int64_t* p = par.data_ptr<int64_t>();
    const int64_t* t = tok.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(p[b * nodes] == -1, op, ": parents[", b, ", 0] must be -1 (node 0 is the root), got ", p[b * nodes]);
      for (int64_t i = 1; i < nodes; ++i) {
        const int64_t pi = p[b * nodes + i];
        TORCH_CHECK(pi >= 0 && pi < i, op, ": parents[", b, ", ", i, "] must be in [0, ", i,
                    ") (nodes in topological order), got ", pi);
        const int64_t ti = t[b * nodes + i];
        TORCH_CHECK(ti >= 0 && ti < vocab, op, ": draft_tokens[", b, ", ", i, "] must be a token id in [0, ", vocab,
                    "), got ", ti);
      }
    }
  }
}

void check_verify_result(const at::Tensor& target_logits, const at::Tensor& accept_len) {
  if (!host_readable(accept_len)) return;
  const int64_t* n = accept_len.data_ptr<int64_t>();
  for (int64_t b = 0; b < accept_len.numel(); ++b) {
    if (n[b] >= 0) continue;
    auto rows = target_logits[b].to(at::kFloat);  // [T, V]; the error path only
    auto bad = (rows.isnan() | rows.isposinf()).any(1) | rows.isneginf().all(1);
    const int64_t node = bad.to(at::kLong).argmax().item<int64_t>();
    TORCH_CHECK(false, "jakiro::verify_tree: target_logits[", b, ", ", node,
                "] give no distribution (a NaN or +inf logit, or every logit -inf): the target's logits must be ",
                "finite; no token is accepted from them");
  }
}

void check_compact_kv(const at::Tensor& cache, const at::Tensor& prefix_lens, const at::Tensor& path,
                      const at::Tensor& path_len) {
  const char* op = "jakiro::compact_kv";
  TORCH_CHECK(cache.dim() >= 4, op, ": cache must have shape [..., B, H, S, D], got ", cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), op, ": cache must be contiguous, got strides ", cache.strides());
  const int64_t batch = cache.size(-4), capacity = cache.size(-2);
  check_lengths(op, "prefix_lens", prefix_lens, batch);
  check_lengths(op, "path_len", path_len, batch);
  check_dim(op, "path", path, 2, "[B, P]");
  check_dtype(op, "path", path, {at::kLong});
  check_size(op, "path", path, 0, batch, "batch, as cache.shape[-4]");
  for (auto* t : {&prefix_lens, &path, &path_len}) check_same_device(op, "every index tensor", *t, cache);
  if (host_readable(path)) {
    auto pa = path.contiguous(), pl = prefix_lens.contiguous(), n = path_len.contiguous();
    const int64_t* pp = pa.data_ptr<int64_t>();
    const int64_t width = path.size(1);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = n.data_ptr<int64_t>()[b], prefix = pl.data_ptr<int64_t>()[b];
      TORCH_CHECK(len >= 0 && len <= width, op, ": path_len[", b, "] must be in [0, path.shape[1] = ", width, "], got ", len);
      TORCH_CHECK(prefix >= 0, op, ": prefix_lens[", b, "] must be >= 0, got ", prefix);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t src = pp[b * width + j];
        TORCH_CHECK(src >= (j == 0 ? 0 : pp[b * width + j - 1] + 1), op, ": path[", b, "] must hold strictly increasing ",
                    "tree indices >= 0 (a root-to-node path), got ", src, " at position ", j);
        TORCH_CHECK(src < capacity - prefix, op, ": prefix_lens[", b, "] + path[", b, ", ", j, "] = ", prefix + src,
                    " is beyond the cache capacity ", capacity, " (cache.shape[-2])");
      }
    }
  }
}

int64_t check_dequantize_rows(const at::Tensor& packed, const at::Tensor& rows) {
  const char* op = "jakiro::dequantize_rows";
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  quant_format_of_chunk(packed.size(2)) != QuantFormat::kNone,
              op, ": packed must be a packed quantized weight, uint8 [N / 16, K / 32, 16 B] with 16 B = 288 (Q4_0), ",
              "320 (Q4_1) or 544 (Q8_0) (jakiro_ext.ops.quantized.pack), got ", packed.scalar_type(), " of shape ",
              packed.sizes());
  TORCH_CHECK(packed.is_contiguous(), op, ": packed must be contiguous (as jakiro_ext.ops.quantized.pack makes it), ",
              "got strides ", packed.strides());
  check_dtype(op, "rows", rows, {at::kLong});
  check_same_device(op, "rows", rows, packed);
  const int64_t N = packed.size(0) * kQuantLanes;
  if (host_readable(rows) && rows.numel() > 0) {
    const auto r = rows.contiguous();
    const int64_t* p = r.data_ptr<int64_t>();
    const auto [lo, hi] = std::minmax_element(p, p + r.numel());
    TORCH_CHECK_INDEX(*lo >= 0 && *hi < N, op, ": rows must be in [0, ", N, ") (the weight's rows, packed.shape[0] * 16), ",
                      "got values in [", *lo, ", ", *hi, "]");
  }
  return packed.size(1) * kQuantBlock;
}

int64_t default_num_splits(int64_t batch, int64_t kv_heads, int64_t max_kv_len, int64_t workers,
                           int64_t min_split_len) {
  const int64_t tasks = std::max<int64_t>(1, batch * kv_heads);
  const int64_t wanted = (2 * workers + tasks - 1) / tasks;  // two tasks per worker: balance
  const int64_t by_length = std::max<int64_t>(1, max_kv_len / std::max<int64_t>(1, min_split_len));
  return std::max<int64_t>(1, std::min(wanted, by_length));
}

}  // namespace jakiro
