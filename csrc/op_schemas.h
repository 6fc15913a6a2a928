// The schemas of every jakiro op, in one place. torch_bindings.cpp declares them under the
// `jakiro` namespace; the SIMT-emulated GPU kernels (csrc/simt) declare the same schemas under
// their own test namespace.
#pragma once

#include <torch/library.h>

namespace jakiro {

// The version of the schemas below, as the library reports it (jakiro_ext.ops.schema_version()),
// for the projects that call the ops: raised whenever a schema changes (an argument, its type, its
// default, a result), which python_tests/ops/test_schema_version.py enforces.
inline constexpr int kSchemaVersion = 2;

inline void define_ops(torch::Library& m) {
  // Tree attention over a KV cache, split-KV (FlashDecoding-style): partial results per split,
  // then the merge. Returns out [B, T, Hq, D] (q's dtype) and lse [B, T, Hq] (float32).
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_lens, Tensor tree_mask, "
      "float? scale=None, int? num_splits=None) -> (Tensor out, Tensor lse)");
  // The first half alone: out_partial [B, T, Hq, splits, D] and lse_partial [B, T, Hq, splits], float32.
  m.def(
      "tree_attention_partial(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_lens, Tensor tree_mask, "
      "int num_splits, float? scale=None) -> (Tensor out_partial, Tensor lse_partial)");
  // The second half alone: merge partial attention states by their log-sum-exp.
  m.def(
      "merge_attention_states(Tensor out_partial, Tensor lse_partial, ScalarType? out_dtype=None) "
      "-> (Tensor out, Tensor lse)");
  // Jakiro's MoE feed-forward block: router (N + 2 logits), top-2 of N experts (SwiGLU), residual.
  m.def(
      "moe_top2(Tensor x, Tensor router_weight, Tensor w_gate, Tensor w_up, Tensor w_down, bool renormalize=False) "
      "-> (Tensor out, Tensor expert_out, Tensor expert_idx, Tensor expert_score, Tensor contrast_weight)");
  // LM head + log-softmax + top-k of the feature h_a, or of w_hi * h_a - w_lo * h_b.
  m.def(
      "contrastive_topk(Tensor h_a, Tensor? h_b, Tensor? contrast_weight, Tensor lm_head, int k) "
      "-> (Tensor logprobs, Tensor token_ids)");
  // RMSNorm of s = x (+ residual) times weight, as the Llama checkpoints' code computes it (the sum
  // in x's dtype, the norm in float32, rounded to x's dtype, then times weight); returns (out, s).
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual=None) -> (Tensor out, Tensor sum)");
  // RoPE (rotate-half layout) of the q and k heads of a fused qkv projection [B, T, Hq + 2 Hkv, D],
  // k and v written to the cache [2, B, Hkv, S, D] at slots lengths[b] + t; returns the rotated q.
  m.def(
      "rope_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor lengths) -> Tensor q");
  // One Llama decoder layer over T new tokens per sequence after each one's cached prefix: with
  // the residual stream residual + delta (residual absent before the first layer),
  //   h, s = rms_norm(delta, input_norm, eps, residual); q = rope_kv_write(h @ qkv_weight^T (+ qkv_bias))
  //   h, s = rms_norm(tree_attention(q, kv_cache) @ o_weight^T, post_norm, eps, s)
  //   gate, up = split(h @ gate_up_weight^T); delta = (SiLU(gate) * up) @ down_weight^T
  // and returns (s, delta): one call instead of about ten a layer. kv_cache is written at
  // lengths[b] + t as by rope_kv_write.
  m.def(
      "decoder_layer(Tensor delta, Tensor? residual, Tensor input_norm, Tensor qkv_weight, Tensor? qkv_bias, "
      "Tensor o_weight, Tensor post_norm, Tensor gate_up_weight, Tensor down_weight, Tensor cos, Tensor sin, "
      "Tensor(a!) kv_cache, Tensor lengths, Tensor tree_mask, float eps) -> (Tensor residual, Tensor delta)");
  // decoder_layer applied to L layers in turn (layer l with the l-th tensor of each list and
  // kv_cache[l]; qkv_biases one per layer or none), the residual stream passed from each to the
  // next: one call for a model's layers.
  m.def(
      "decoder_layers(Tensor delta, Tensor? residual, Tensor[] input_norms, Tensor[] qkv_weights, "
      "Tensor[] qkv_biases, Tensor[] o_weights, Tensor[] post_norms, Tensor[] gate_up_weights, "
      "Tensor[] down_weights, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor lengths, Tensor tree_mask, "
      "float eps) -> (Tensor residual, Tensor delta)");
  // SiLU(gate) * up of a fused [..., 2 I] projection ([gate | up]), in float32, rounded once: [..., I].
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  // y = x @ weight^T (+ bias) for x [..., K], weight [N, K]: the weight streamed once at decoding sizes.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // Rows `rows` (int64, any shape) of a packed quantized weight [N / 16, K / 32, 16 B] (jakiro/quant.h),
  // dequantized as GGML does: float32 [*rows.shape, K]. A quantized embedding table's lookup.
  m.def("dequantize_rows(Tensor packed, Tensor rows) -> Tensor");
  // Gumiho's parallel MLP heads on one input x [..., K]: head j is h = SiLU(x W_in[j]^T + b_in[j]),
  // then per block b, h = h + SiLU(h W_blocks[j, b]^T + b_blocks[j, b]); out [..., J, H].
  m.def("mlp_heads(Tensor x, Tensor w_in, Tensor b_in, Tensor w_blocks, Tensor b_blocks) -> Tensor");
  // Accept the longest valid path of a draft tree against the target's logits (greedy or lossless sampling).
  m.def(
      "verify_tree(Tensor parents, Tensor draft_tokens, Tensor target_logits, Tensor? uniforms=None, "
      "float temperature=0.0, float top_p=1.0, int top_k=0) -> (Tensor path, Tensor accept_len, Tensor bonus)");
  // Move the accepted path's cache entries into place right after each sequence's prefix (in place).
  m.def("compact_kv(Tensor(a!) cache, Tensor prefix_lens, Tensor path, Tensor path_len) -> ()");
  // The bad index values the GPU kernels met (and skipped instead of reading or writing out of
  // bounds) on like's device since the last call: DeviceError bits, int32 [1] on that device,
  // read and cleared in stream order. Always 0 on the CPU, whose ops raise at once.
  m.def("device_errors(Tensor like) -> Tensor");
}

}  // namespace jakiro
