// The CPU kernels other CPU kernels call directly (jakiro::decoder_layer composes them): the
// functions registered as the ops' CPU implementations, same arguments, same checks.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace jakiro::cpu {

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// Whether many float32 rows (a prompt) go to torch's oneDNN linear rather than ATen's (MKL).
bool onednn_linear_enabled();
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                const std::optional<at::Tensor>& residual);
at::Tensor rope_kv_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& kv_cache, const at::Tensor& lengths);
std::tuple<at::Tensor, at::Tensor> tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                                      const at::Tensor& tree_mask, std::optional<double> scale,
                                                      std::optional<int64_t> num_splits);
at::Tensor silu_mul_cpu(const at::Tensor& gate_up);

}  // namespace jakiro::cpu
