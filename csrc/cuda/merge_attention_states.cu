// Torch glue of the GPU split-KV merge (kernel: kernels/merge_attention_states.cuh).
#include "cuda/kernels/merge_attention_states.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

std::tuple<at::Tensor, at::Tensor> merge_attention_states_gpu(const at::Tensor& out_partial,
                                                              const at::Tensor& lse_partial,
                                                              std::optional<at::ScalarType> out_dtype) {
  const auto dtype = check_merge_attention_states(out_partial, lse_partial, out_dtype);
  const DeviceScope scope(out_partial);
  auto op_c = out_partial.contiguous();
  auto lse_c = lse_partial.contiguous();
  const int64_t B = op_c.size(0), T = op_c.size(1), H = op_c.size(2), S = op_c.size(3), D = op_c.size(4);
  auto out = at::empty({B, T, H, D}, op_c.options().dtype(dtype));
  auto lse = at::empty({B, T, H}, lse_c.options());
  const MergeParams p{op_c.data_ptr<float>(), lse_c.data_ptr<float>(), out.data_ptr(), lse.data_ptr<float>(),
                      B * T * H, S, D};
  JAKIRO_DISPATCH_FLOAT_BF16(dtype, "merge_attention_states_gpu", [&] {
    launch_merge_attention_states<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return {out, lse};
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("merge_attention_states", &merge_attention_states_gpu); }

}  // namespace jakiro::gpu
