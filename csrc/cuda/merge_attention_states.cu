// CUDA kernel of the split-KV merge (the first CUDA kernel; the rest come with the GPU issue).
// Portable CUDA C++: no PTX, no tensor cores; hipify turns it into HIP unchanged.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "jakiro/softmax.h"
#include "ops.h"

namespace jakiro::cuda {
namespace {

// One block per (b, t, head) row; threads stride over the head dimension.
template <typename out_t>
__global__ void merge_attention_states_kernel(const float* __restrict__ out_partial,
                                              const float* __restrict__ lse_partial, out_t* __restrict__ out,
                                              float* __restrict__ lse, int64_t splits, int64_t dim) {
  const int64_t row = blockIdx.x;
  const float* lses = lse_partial + row * splits;
  float max_lse = neg_inf();
  for (int64_t s = 0; s < splits; ++s) max_lse = fmaxf(max_lse, lses[s]);
  float total = 0.f;
  if (max_lse != neg_inf()) {
    for (int64_t s = 0; s < splits; ++s) total += merge_weight(lses[s], max_lse);
  }
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = 0.f;
    if (total > 0.f) {
      for (int64_t s = 0; s < splits; ++s) {
        const float w = merge_weight(lses[s], max_lse);
        if (w != 0.f) acc += w * out_partial[(row * splits + s) * dim + d];
      }
      acc /= total;
    }
    out[row * dim + d] = static_cast<out_t>(acc);
  }
  if (threadIdx.x == 0) lse[row] = total > 0.f ? max_lse + logf(total) : neg_inf();
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cuda(const at::Tensor& out_partial,
                                                               const at::Tensor& lse_partial,
                                                               std::optional<at::ScalarType> out_dtype) {
  const auto dtype = check_merge_attention_states(out_partial, lse_partial, out_dtype);
  const c10::cuda::CUDAGuard device_guard(out_partial.device());
  auto op_c = out_partial.contiguous();
  auto lse_c = lse_partial.contiguous();
  const int64_t B = op_c.size(0), T = op_c.size(1), H = op_c.size(2), S = op_c.size(3), D = op_c.size(4);
  auto out = at::empty({B, T, H, D}, op_c.options().dtype(dtype));
  auto lse = at::empty({B, T, H}, lse_c.options());
  const int64_t rows = B * T * H;
  if (rows == 0) return {out, lse};
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = static_cast<int>(std::min<int64_t>(128, ((D + 31) / 32) * 32));
  JAKIRO_DISPATCH_FLOAT_BF16(dtype, "merge_attention_states_cuda", [&] {
    merge_attention_states_kernel<scalar_t><<<rows, threads, 0, stream>>>(
        op_c.data_ptr<float>(), lse_c.data_ptr<float>(), out.data_ptr<scalar_t>(), lse.data_ptr<float>(), S, D);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(jakiro, CUDA, m) { m.impl("merge_attention_states", &merge_attention_states_cuda); }

}  // namespace jakiro::cuda
