// Torch glue of the GPU jakiro::moe_top2 (kernels: kernels/moe_top2.cuh).
#include "cuda/kernels/moe_top2.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_top2_gpu(
    const at::Tensor& x, const at::Tensor& router_weight, const at::Tensor& w_gate, const at::Tensor& w_up,
    const at::Tensor& w_down, bool renormalize) {
  const auto sh = check_moe_top2(x, router_weight, w_gate, w_up, w_down, /*bf16_weights=*/false);
  const DeviceScope scope(x);
  const int64_t M = sh.tokens, H = sh.hidden, N = sh.experts, I = sh.intermediate;
  auto x2 = x.reshape({M, H}).contiguous();
  auto rw = router_weight.contiguous(), wg = w_gate.contiguous(), wu = w_up.contiguous(), wd = w_down.contiguous();
  const MoeOutputs outputs = empty_moe_outputs(x);
  const at::Tensor &expert_out = outputs.expert_out, &expert_idx = outputs.expert_idx;
  const at::Tensor &expert_score = outputs.expert_score, &contrast_weight = outputs.contrast_weight;
  auto out = at::empty_like(x2);
  auto h = at::empty({M * 2, I}, x.options().dtype(at::kFloat));  // SiLU(gate) * up per (token, slot), float32
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "moe_top2_gpu", [&] {
    const MoeParams p{x2.data_ptr(),
                      rw.data_ptr(),
                      wg.data_ptr(),
                      wu.data_ptr(),
                      wd.data_ptr(),
                      out.data_ptr(),
                      expert_out.data_ptr(),
                      expert_idx.data_ptr<int64_t>(),
                      expert_score.data_ptr<float>(),
                      contrast_weight.data_ptr<float>(),
                      h.data_ptr<float>(),
                      M,
                      H,
                      N,
                      I,
                      renormalize,
                      0,
                      0};
    launch_moe_top2<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return {out.view(x.sizes()), expert_out, expert_idx, expert_score, contrast_weight};
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("moe_top2", &moe_top2_gpu); }

}  // namespace jakiro::gpu
