// CPU kernels of jakiro::decoder_layer (a Llama decoder layer in one call: the composition of
// csrc/decoder_layer.h over the CPU kernels themselves, no dispatch or Python between the parts)
// and jakiro::silu_mul (the SwiGLU activation of the fused [gate | up] projection in one pass,
// three eager ATen calls and two temporaries otherwise).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/kernels.h"
#include "cpu/layer_rows.h"
#include "decoder_layer.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

constexpr int64_t kSiluRowsPerTask = 8;

struct CpuOps {
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

std::tuple<at::Tensor, at::Tensor> decoder_layer_cpu(
    const at::Tensor& delta, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& lengths, const at::Tensor& tree_mask,
    double eps) {
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
