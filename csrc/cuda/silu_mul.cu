// Torch glue of the GPU jakiro::silu_mul (kernel: kernels/silu_mul.cuh).
#include "cuda/kernels/silu_mul.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

at::Tensor silu_mul_gpu(const at::Tensor& gate_up) {
  check_silu_mul(gate_up);
  const DeviceScope scope(gate_up);
  const int64_t I = gate_up.size(-1) / 2;
  auto shape = gate_up.sizes().vec();
  shape.back() = I;
  auto x = gate_up.contiguous();
  auto out = at::empty(shape, x.options());
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "silu_mul_gpu", [&] {
    const SiluMulParams p{x.data_ptr(), out.data_ptr(), x.numel() / (2 * I), I};
    launch_silu_mul<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return out;
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("silu_mul", &silu_mul_gpu); }

}  // namespace jakiro::gpu
