// Torch glue of the GPU jakiro::mlp_heads (kernel: kernels/mlp_heads.cuh).
#include "cuda/kernels/mlp_heads.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

at::Tensor mlp_heads_gpu(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& b_in, const at::Tensor& w_blocks,
                         const at::Tensor& b_blocks) {
  const MlpHeadsShape sh = check_mlp_heads(x, w_in, b_in, w_blocks, b_blocks);
  const DeviceScope scope(x);
  const int64_t M = sh.rows, K = sh.in_features, J = sh.heads, H = sh.hidden, NB = sh.blocks;
  auto out_shape = x.sizes().vec();
  out_shape.back() = J;
  out_shape.push_back(H);
  auto x2 = x.reshape({M, K}).contiguous();
  auto wi = w_in.contiguous(), bi = b_in.contiguous(), wb = w_blocks.contiguous(), bb = b_blocks.contiguous();
  auto out = at::empty({M, J, H}, x.options());
  auto act = at::empty({2, J, M, H}, x.options().dtype(at::kFloat));  // a layer's input and output, float32
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "mlp_heads_gpu", [&] {
    const MlpHeadsParams p{x2.data_ptr(), wi.data_ptr(), bi.data_ptr(), wb.data_ptr(), bb.data_ptr(),
                           act.data_ptr<float>(), out.data_ptr(), M, K, J, H, NB, 0};
    launch_mlp_heads<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return out.view(out_shape);
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("mlp_heads", &mlp_heads_gpu); }

}  // namespace jakiro::gpu
