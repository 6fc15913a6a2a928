// CPU kernel of jakiro::linear, y = x @ W^T (+ b): the projections and LM heads of the target and
// the draft. At decoding and tree-verification sizes the product is bound by reading W, and
// BLAS's packing wastes most of that (measured: 3-10 GB/s on the LM head at 1-16 rows), so W is
// streamed exactly once by a skinny kernel (cpu/skinny_avx512.h where the CPU has AVX-512, else
// cpu/skinny_gemm.h), the threads splitting the output columns. Each output
// row is computed in the same order whatever the number of rows, so a token's logits do not
// depend on how many tree tokens share its forward. Many float32 rows (a prompt) go to ATen's linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"
#include "cpu/vec_utils.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

// Output columns per unit of the split (a multiple of the 4-row W block). Each thread takes one
// contiguous run of units and streams it in one call, so the unit only sets the balance: a
// 576-column projection splits 18/18 between two threads in units of 16, 5/4 in units of 64.
constexpr int64_t kColumnBlock = 16;

}  // namespace

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_linear(x, weight, bias);
  const int64_t K = x.size(-1), N = weight.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  // BLAS wins beyond kLinearStreamRows rows: float32 always, bf16 where the CPU multiplies bf16
  // natively (oneDNN's AMX / AVX512-BF16 kernels: a 4096 x 576 x 1536 product at 3.4 TFLOP/s on a
  // 2-core Xeon with AMX, 8x float32's). Without native bf16 (AVX2), bf16 BLAS was slower at every
  // size measured, so bf16 streams in chunks of rows that stay in L2. Sequences of at most
  // kLinearStreamRows tokens each (x [..., T, K], a batch's trees) stream in chunks too, whatever
  // the dtype: a sequence's result never depends on the batch it shares.
  const bool is_float = x.scalar_type() == at::kFloat;
  const bool blas = is_float || bf16_dot_enabled();
  const bool short_sequences = x.dim() >= 3 && x.size(-2) <= kLinearStreamRows;
  if (M == 0 || (blas && M > kLinearStreamRows && !short_sequences)) return at::linear(x, weight, bias);

  auto w = weight.contiguous();
  auto out = at::empty({M, N}, x.options());
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  // Each task owns a block of output columns for every row: W is read once, by one thread. The
  // product lands in float32 (in `out` itself when it is float32), then the bias is added and the
  // block is rounded to x's dtype, all inside the task: no further pass or call.
  auto over_column_blocks = [&](auto&& product) {
    JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "linear_cpu_out", [&] {
      scalar_t* po = out.data_ptr<scalar_t>();
      const scalar_t* pb = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kLinearStreamRows) {
        const int64_t rows = std::min(kLinearStreamRows, M - m0);
        at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
          const int64_t j0 = b0 * kColumnBlock, j1 = std::min(N, b1 * kColumnBlock), n = j1 - j0;
          std::vector<float> scratch(is_float ? 0 : rows * n);
          float* y = is_float ? reinterpret_cast<float*>(po) + m0 * N + j0 : scratch.data();
          const int64_t ldy = is_float ? N : n;
          product(m0, rows, j0, j1, y, ldy);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < n; ++j) {
              const float v = pb == nullptr ? y[r * ldy + j] : y[r * ldy + j] + static_cast<float>(pb[j0 + j]);
              po[(m0 + r) * N + j0 + j] = static_cast<scalar_t>(v);
            }
          }
        });
      }
    });
  };
  if (!is_float && bf16_dot_enabled()) {  // native bf16 dot products (AVX512-BF16)
    auto xb = x2.contiguous();
    const auto* px = reinterpret_cast<const c10::BFloat16*>(xb.data_ptr());
    const auto* pw = reinterpret_cast<const c10::BFloat16*>(w.data_ptr());
    over_column_blocks([&](int64_t m0, int64_t rows, int64_t j0, int64_t j1, float* y, int64_t ldy) {
      skinny_gemm_nt_bf16_dot(px + m0 * K, rows, K, pw, K, K, j0, j1, y, ldy);
    });
  } else {  // float32 products, bf16 weights widened: on 512-bit vectors where the CPU has AVX-512
    auto xf = x2.to(at::kFloat).contiguous();
    const float* px = xf.data_ptr<float>();
    const bool wide = avx512_enabled();
    JAKIRO_DISPATCH_FLOAT_BF16(weight.scalar_type(), "linear_cpu", [&] {
      const scalar_t* pw = w.data_ptr<scalar_t>();
      over_column_blocks([&](int64_t m0, int64_t rows, int64_t j0, int64_t j1, float* y, int64_t ldy) {
        if (wide)
          skinny_gemm_nt_avx512(px + m0 * K, rows, K, pw, K, K, j0, j1, y, ldy);
        else
          skinny_gemm_nt(px + m0 * K, rows, K, pw, K, K, j0, j1, y, ldy);
      });
    });
  }
  return out.view(out_shape);
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace jakiro::cpu
