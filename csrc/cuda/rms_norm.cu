// Torch glue of the GPU jakiro::rms_norm (kernel: kernels/rms_norm.cuh).
#include "cuda/kernels/rms_norm.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_gpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                const std::optional<at::Tensor>& residual) {
  check_rms_norm(x, weight, eps, residual);
  const DeviceScope scope(x);
  const int64_t H = x.size(-1);
  auto xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor rc = residual.has_value() ? residual->contiguous() : at::Tensor();
  auto out = at::empty(x.sizes(), xc.options()), sum = at::empty(x.sizes(), xc.options());
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "rms_norm_gpu", [&] {
    const RmsNormParams p{xc.data_ptr(), rc.defined() ? rc.data_ptr() : nullptr, wc.data_ptr(), out.data_ptr(),
                          sum.data_ptr(), x.numel() / H, H, static_cast<float>(eps)};
    launch_rms_norm<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return {out, sum};
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("rms_norm", &rms_norm_gpu); }

}  // namespace jakiro::gpu
