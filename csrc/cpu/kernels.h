// The CPU kernels other CPU kernels call directly (jakiro::decoder_layer composes them): the
// functions registered as the ops' CPU implementations, same arguments, same checks.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "ops.h"

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

// fn(rows, keys, values): the data of activation rows and of a KV cache's keys and values in their
// dtypes: one dtype (float32 or bf16), or float32 rows beside a bf16 cache (check_cache_dtype).
template <typename Fn>
void with_cache_dtypes(const at::Tensor& rows, const at::Tensor& keys, const at::Tensor& values, Fn&& fn) {
  if (keys.scalar_type() != rows.scalar_type()) {
    fn(rows.data_ptr<float>(), keys.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>());
    return;
  }
  JAKIRO_DISPATCH_FLOAT_BF16(rows.scalar_type(), "with_cache_dtypes", [&] {
    fn(rows.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>());
  });
}

}  // namespace jakiro::cpu
