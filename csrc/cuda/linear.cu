// Torch glue of the GPU jakiro::linear (kernel: kernels/linear.cuh).
#include "cuda/kernels/linear.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

at::Tensor linear_gpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_linear(x, weight, bias);
  const DeviceScope scope(x);
  const int64_t K = x.size(-1), N = weight.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  int64_t M = 1;  // rows: the product of the leading dims (reshape(-1, K) fails for K = 0)
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  auto x2 = x.reshape({M, K}).contiguous();
  auto w = weight.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto y = at::empty({M, N}, x2.options());
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "linear_gpu", [&] {
    const LinearParams p{x2.data_ptr(), w.data_ptr(), b.defined() ? b.data_ptr() : nullptr, y.data_ptr(), M, K, N, 0};
    launch_linear<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return y.view(out_shape);
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("linear", &linear_gpu); }

}  // namespace jakiro::gpu
