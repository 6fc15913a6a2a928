// Device-agnostic argument validation of every jakiro op. Each backend's kernel calls the
// matching check first, so CPU and GPU accept and reject exactly the same inputs.
// The schemas live in torch_bindings.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <optional>

namespace jakiro {

struct TreeAttentionShape {
  int64_t batch, tree_len, q_heads, kv_heads, head_dim, capacity;
  int64_t longest_prefix = -1;  // max(prefix_lens), when the check could read them (on the host); else -1
  int64_t group() const { return q_heads / kv_heads; }
};

// q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; prefix_lens [B] int64;
// tree_mask [B, T, ceil(T/64)] int64. Also checks prefix_lens[b] + T <= S (reads prefix_lens).
// The caches have q's dtype, or with `bf16_cache` (the CPU kernels) bfloat16 beside a float32 q
// (check_cache_dtype).
TreeAttentionShape check_tree_attention(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                        const at::Tensor& tree_mask, bool bf16_cache = false);

// The softmax scale as float: `scale` (finite, also as float32) or 1 / sqrt(head_dim).
float attention_scale(const char* op, std::optional<double> scale, int64_t head_dim);

// out_partial [B, T, H, splits, D] float32, lse_partial [B, T, H, splits] float32; out_dtype
// float32 or bfloat16. Returns the output dtype (float32 when none is given).
at::ScalarType check_merge_attention_states(const at::Tensor& out_partial, const at::Tensor& lse_partial,
                                            std::optional<at::ScalarType> out_dtype);

struct MoeShape {
  int64_t tokens, hidden, experts, intermediate;
};
// x [..., H]; router_weight [N + 2, H]; w_gate, w_up [N, I, H]; w_down [N, H, I]; 2 <= N <= 8; all
// of x's dtype, or where the kernel reads them (`bf16_weights`: the CPU's) the experts' weights in
// bfloat16 beside a float32 x and router (check_weight_dtype).
MoeShape check_moe_top2(const at::Tensor& x, const at::Tensor& router_weight, const at::Tensor& w_gate,
                        const at::Tensor& w_up, const at::Tensor& w_down, bool bf16_weights);

// h_a [..., H]; h_b like h_a or absent; contrast_weight [..., 2] (present iff h_b is);
// lm_head [V, H] of h_a's dtype; 1 <= k <= V. `bf16_weights` (the CPU kernel): a float32 h_a
// also takes a bfloat16 lm_head (check_weight_dtype) or a packed quantized one [V / 16, H / 32, 16 B]
// uint8 (check_weight_matrix).
void check_contrastive_topk(const at::Tensor& h_a, const std::optional<at::Tensor>& h_b,
                            const std::optional<at::Tensor>& contrast_weight, const at::Tensor& lm_head, int64_t k,
                            bool bf16_weights = false);

// The per-token outputs of moe_top2, shaped like x's leading dims, allocated on x's device:
// expert_out [..., 2, H] (x's dtype), expert_idx [..., 2] int64, expert_score and
// contrast_weight [..., 2] float32. Every backend returns these.
struct MoeOutputs {
  at::Tensor expert_out, expert_idx, expert_score, contrast_weight;
};
MoeOutputs empty_moe_outputs(const at::Tensor& x);

// x [..., H] with H >= 1; weight [H]; residual like x or absent; eps finite and >= 0; one dtype
// (float32 or bfloat16), one device.
void check_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::optional<at::Tensor>& residual);

struct RopeKvShape {
  int64_t batch, tokens, q_heads, kv_heads, head_dim, capacity;
};
// qkv [B, T, Hq + 2 Hkv, D] (Hq >= 1, D even); cos, sin [B, T, D]; kv_cache [2, B, Hkv, S, D]
// with contiguous [S, D] rows; lengths [B] int64 with lengths[b] + T <= S (read on the host);
// one dtype (float32 or bfloat16) but lengths, one device; `bf16_cache` (the CPU kernel): a
// float32 qkv also writes a bfloat16 cache (check_cache_dtype).
RopeKvShape check_rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& kv_cache, const at::Tensor& lengths, bool bf16_cache = false);

struct DecoderLayerShape {
  int64_t batch, tokens, hidden, q_heads, kv_heads, head_dim, intermediate;
};
// delta [B, T, H]; residual like delta or absent; input_norm, post_norm [H]; qkv_weight
// [(Hq + 2 Hkv) D, H]; qkv_bias [(Hq + 2 Hkv) D] or absent; o_weight [H, Hq D]; gate_up_weight
// [2 I, H]; down_weight [H, I]; kv_cache [2, B, Hkv, S, D] (Hkv and D from it, Hq from o_weight);
// cos, sin [B, T, D]; lengths [B] int64; tree_mask [B, T, ceil(T / 64)] int64; eps finite and
// >= 0; one dtype (float32 or bfloat16) but the index tensors, one device; `bf16_weights` (the
// CPU kernel): float32 rows also take the four projection weights in bfloat16 (check_weight_dtype)
// or packed quantized (jakiro/quant.h; the shapes above are then their matrices'), and the same
// kernel a bfloat16 kv_cache (check_cache_dtype). The cache positions and the mask are checked by
// the parts (rope_kv_write, tree_attention).
DecoderLayerShape check_decoder_layer(const at::Tensor& delta, const std::optional<at::Tensor>& residual,
                                      const at::Tensor& input_norm, const at::Tensor& qkv_weight,
                                      const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
                                      const at::Tensor& post_norm, const at::Tensor& gate_up_weight,
                                      const at::Tensor& down_weight, const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& kv_cache, const at::Tensor& lengths,
                                      const at::Tensor& tree_mask, double eps, bool bf16_weights = false,
                                      bool bf16_cache = false);

// jakiro::decoder_layers: L >= 1 layers, every list L tensors long (qkv_biases L, or empty: no
// bias), kv_cache [L, 2, B, Hkv, S, D]; layer l checked by check_decoder_layer with kv_cache[l]
// (its errors name the layer), every layer of one MLP width and one weight dtype. Returns the
// layers' shape.
DecoderLayerShape check_decoder_layers(const at::Tensor& delta, const std::optional<at::Tensor>& residual,
                                       at::TensorList input_norms, at::TensorList qkv_weights,
                                       at::TensorList qkv_biases, at::TensorList o_weights, at::TensorList post_norms,
                                       at::TensorList gate_up_weights, at::TensorList down_weights,
                                       const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                                       const at::Tensor& lengths, const at::Tensor& tree_mask, double eps,
                                       bool bf16_weights = false, bool bf16_cache = false);

// gate_up [..., 2 I] with I >= 1, float32 or bfloat16.
void check_silu_mul(const at::Tensor& gate_up);

// x [..., K]; weight [N, K]; bias [N] or absent; one dtype (float32 or bfloat16), one device;
// `bf16_weights` (the CPU kernel): a float32 x also takes a bfloat16 weight (check_weight_dtype)
// or a packed quantized one [N / 16, K / 32, 16 B] uint8 (jakiro/quant.h, check_weight_matrix).
void check_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  bool bf16_weights = false);
struct MlpHeadsShape {
  int64_t rows, in_features, heads, hidden, blocks;
};
// x [..., K]; w_in [J, H, K]; b_in [J, H]; w_blocks [J, NB, H, H]; b_blocks [J, NB, H]; one dtype
// (float32 or bfloat16), one device.
MlpHeadsShape check_mlp_heads(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& b_in,
                              const at::Tensor& w_blocks, const at::Tensor& b_blocks);

// Float32 rows up to which jakiro::linear streams the weight itself (beyond: BLAS); measured
// with benchmarks/bench_linear.py.
constexpr int64_t kLinearStreamRows = 64;

// parents, draft_tokens [B, T] int64 (parents[b, 0] == -1, 0 <= parents[b, i] < i: read on the
// host); target_logits [B, T, V]; uniforms [B, T + 1] float64 when temperature > 0.
void check_verify_tree(const at::Tensor& parents, const at::Tensor& draft_tokens, const at::Tensor& target_logits,
                       const std::optional<at::Tensor>& uniforms, double temperature, double top_p, int64_t top_k);

// After verification: a sequence whose walk reached logits that give no distribution (a NaN or
// +inf logit, or all -inf) has accept_len -1. On host tensors this raises, naming the first
// such node; on a GPU (no sync here) the -1 is the caller's to check.
void check_verify_result(const at::Tensor& target_logits, const at::Tensor& accept_len);

// cache [..., B, H, S, D] contiguous; prefix_lens, path_len [B] int64; path [B, P] int64 with
// strictly increasing tree indices, path_len[b] <= P and prefix_lens[b] + path[b, -1] < S.
void check_compact_kv(const at::Tensor& cache, const at::Tensor& prefix_lens, const at::Tensor& path,
                      const at::Tensor& path_len);

// Chosen number of KV splits when the caller gives none: enough (batch x KV head x split)
// tasks to keep every thread busy, and splits no shorter than `min_split_len` keys.
int64_t default_num_splits(int64_t batch, int64_t kv_heads, int64_t max_kv_len, int64_t workers,
                           int64_t min_split_len);

// packed: a packed quantized weight, uint8 [N / 16, K / 32, 16 B] (jakiro/quant.h), contiguous;
// rows int64 of any shape on its device, each in [0, N) (read on the host where it can be; a GPU
// kernel reports kBadRows instead). Returns K.
int64_t check_dequantize_rows(const at::Tensor& packed, const at::Tensor& rows);

}  // namespace jakiro

// Dispatch over the two dtypes every floating-point op supports.
#define JAKIRO_DISPATCH_FLOAT_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
