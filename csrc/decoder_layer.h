// jakiro::decoder_layer as a composition of the other jakiro ops, shared by every backend: each
// passes its own kernels as `Ops` (the CPU its C++ functions, the GPU glue its namespace's ops),
// so the layer is one call from Python whatever runs it, and its parts are the tested ops.
// Ops has: rms_norm(x, weight, eps, residual) -> (out, sum); linear(x, weight, bias);
// rope_kv_write(qkv, cos, sin, kv_cache, lengths) -> q; tree_attention(q, k, v, lengths, mask)
// -> out; silu_mul(gate_up); kBf16Weights: whether its linear takes bf16 weights beside float32
// rows (check_weight_dtype); kBf16Cache: whether its rope_kv_write and tree_attention take a bf16
// cache beside them (check_cache_dtype).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace jakiro {

template <typename Ops>
std::tuple<at::Tensor, at::Tensor> compose_decoder_layer(
    const Ops& ops, const at::Tensor& delta, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& lengths, const at::Tensor& tree_mask,
    double eps) {
  const auto s = check_decoder_layer(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                                     gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps,
                                     Ops::kBf16Weights, Ops::kBf16Cache);
  auto [h, stream] = ops.rms_norm(delta, input_norm, eps, residual);
  const auto qkv = ops.linear(h, qkv_weight, qkv_bias).view({s.batch, s.tokens, s.q_heads + 2 * s.kv_heads, s.head_dim});
  const auto q = ops.rope_kv_write(qkv, cos, sin, kv_cache, lengths);
  const auto attention = ops.tree_attention(q, kv_cache.select(0, 0), kv_cache.select(0, 1), lengths, tree_mask);
  const auto o = ops.linear(attention.view({s.batch, s.tokens, s.q_heads * s.head_dim}), o_weight, std::nullopt);
  auto [h2, stream2] = ops.rms_norm(o, post_norm, eps, stream);
  const auto act = ops.silu_mul(ops.linear(h2, gate_up_weight, std::nullopt));
  return {stream2, ops.linear(act, down_weight, std::nullopt)};
}

// jakiro::decoder_layers as `layer` (a decoder_layer of the backend) applied to each layer in
// turn, the residual stream passed on (the lists already checked by check_decoder_layers).
template <typename Layer>
std::tuple<at::Tensor, at::Tensor> compose_decoder_layers(
    const Layer& layer, const at::Tensor& delta, const std::optional<at::Tensor>& residual,
    at::TensorList input_norms, at::TensorList qkv_weights, at::TensorList qkv_biases, at::TensorList o_weights,
    at::TensorList post_norms, at::TensorList gate_up_weights, at::TensorList down_weights, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& lengths, const at::Tensor& tree_mask,
    double eps) {
  std::tuple<at::Tensor, at::Tensor> stream{residual.value_or(at::Tensor()), delta};
  for (size_t l = 0; l < input_norms.size(); ++l) {
    const auto& [r, d] = stream;
    stream = layer(d, r.defined() ? std::optional<at::Tensor>(r) : std::nullopt, input_norms[l], qkv_weights[l],
                   qkv_biases.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_biases[l]), o_weights[l],
                   post_norms[l], gate_up_weights[l], down_weights[l], cos, sin,
                   kv_cache.select(0, static_cast<int64_t>(l)), lengths, tree_mask, eps);
  }
  return stream;
}

}  // namespace jakiro
