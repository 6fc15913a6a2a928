// Torch glue of the GPU tree verification (kernels: kernels/verify_tree.cuh).
#include "cuda/kernels/verify_tree.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_gpu(const at::Tensor& parents,
                                                               const at::Tensor& draft_tokens,
                                                               const at::Tensor& target_logits,
                                                               const std::optional<at::Tensor>& uniforms,
                                                               double temperature, double top_p, int64_t top_k) {
  check_verify_tree(parents, draft_tokens, target_logits, uniforms, temperature, top_p, top_k);
  const DeviceScope scope(parents);
  const int64_t B = parents.size(0), T = parents.size(1), V = target_logits.size(2);
  auto par = parents.contiguous(), tok = draft_tokens.contiguous(), logits = target_logits.contiguous();
  auto path = at::full({B, T}, -1, par.options());
  auto accept_len = at::empty({B}, par.options());
  auto bonus = at::empty({B}, par.options());
  const bool sampling = temperature > 0.0;
  at::Tensor u, choice, weights;
  if (sampling) {
    u = uniforms->contiguous();
    weights = at::empty({B, V}, logits.options().dtype(at::kDouble));
  } else {
    choice = at::empty({B, T}, par.options());
  }
  const VerifyParams p{par.data_ptr<int64_t>(),
                       tok.data_ptr<int64_t>(),
                       logits.data_ptr(),
                       sampling ? u.data_ptr<double>() : nullptr,
                       path.data_ptr<int64_t>(),
                       accept_len.data_ptr<int64_t>(),
                       bonus.data_ptr<int64_t>(),
                       sampling ? nullptr : choice.data_ptr<int64_t>(),
                       sampling ? weights.data_ptr<double>() : nullptr,
                       B,
                       T,
                       V,
                       temperature,
                       top_p,
                       top_k,
                       error_word(parents)};
  JAKIRO_DISPATCH_FLOAT_BF16(logits.scalar_type(), "verify_tree_gpu", [&] {
    launch_verify_tree<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  check_verify_result(target_logits, accept_len);  // host tensors (the emulator) only: no sync
  return {path, accept_len, bonus};
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("verify_tree", &verify_tree_gpu); }

}  // namespace jakiro::gpu
