// Torch glue of the GPU jakiro::linear: bf16 on tensor cores (kernels/linear_wmma.cuh) where the
// device has them, everything else through the CUDA-core skinny GEMM (kernels/linear.cuh). Both
// give every row the same bits whatever the rows beside it.
#include "cuda/kernels/linear.cuh"
#include "cuda/kernels/linear_wmma.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

#if defined(JAKIRO_HAS_WMMA)
// The blocks the split of K aims at: kTlTargetBlocks, or JAKIRO_GPU_LINEAR_BLOCKS (a positive
// integer; the GPU kit sweeps it), read at each call.
int64_t linear_target_blocks() {
  const char* env = std::getenv("JAKIRO_GPU_LINEAR_BLOCKS");
  if (env == nullptr || *env == '\0') return kTlTargetBlocks;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  TORCH_CHECK(*end == '\0' && v >= 1 && v <= (1 << 20),
              "JAKIRO_GPU_LINEAR_BLOCKS must be an integer in [1, 1048576], got '", env, "'");
  return v;
}

// Rows [0, M) of x2 [M, K] bf16 through the tensor-core kernel, kTlLaunchRows at a time when K
// is split (a bounded buffer of partial sums, reused).
void linear_tensor_cores(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b, at::Tensor& y,
                         cudaStream_t stream) {
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  const int64_t splits = tc_linear_splits(N, K, linear_target_blocks());
  const int64_t step = splits > 1 ? kTlLaunchRows : (M > 0 ? M : 1);
  at::Tensor partial;
  if (splits > 1) partial = at::empty({splits, M < step ? M : step, N}, x2.options().dtype(at::kFloat));
  auto* x = reinterpret_cast<const bf16*>(x2.data_ptr());
  auto* out = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t m0 = 0; m0 < M; m0 += step) {
    const int64_t rows = M - m0 < step ? M - m0 : step;
    const TcLinearParams p{x + m0 * K,
                           reinterpret_cast<const bf16*>(w.data_ptr()),
                           b.defined() ? reinterpret_cast<const bf16*>(b.data_ptr()) : nullptr,
                           out + m0 * N,
                           splits > 1 ? partial.data_ptr<float>() : nullptr,
                           rows,
                           K,
                           N,
                           splits};
    launch_linear_wmma(p, stream);
  }
}
#endif

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
#if defined(JAKIRO_HAS_WMMA)
  if (x.scalar_type() == at::kBFloat16 && tensor_cores_enabled(x)) {
    linear_tensor_cores(x2, w, b, y, scope.stream());
    check_launch();
    return y.view(out_shape);
  }
#endif
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
