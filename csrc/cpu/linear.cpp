// CPU kernel of jakiro::linear, y = x @ W^T (+ b): the projections and LM heads of the target and
// the draft. At decoding and tree-verification sizes the product is bound by reading W, and
// BLAS's packing wastes most of that (measured: 3-10 GB/s on the LM head at 1-16 rows), so W is
// streamed exactly once by a skinny kernel (cpu/skinny_avx512.h where the CPU has AVX-512, else
// cpu/skinny_gemm.h), the threads splitting the output columns. Each output
// row is computed in the same order whatever the number of rows, so a token's logits do not
// depend on how many tree tokens share its forward. Many float32 rows (a prompt) go to oneDNN's
// product where torch has it (else ATen's linear).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/quantized.h"
#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"
#include "cpu/vec_utils.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace jakiro::cpu {
template <typename scalar_t, typename weight_t>
void linear_columns(StreamedRows x, int64_t rows, int64_t K, const weight_t* w, const scalar_t* bias, int64_t j0,
                    int64_t j1, scalar_t* y, int64_t ldy, float* scratch) {
  constexpr bool is_float = std::is_same_v<scalar_t, float>;
  const int64_t n = j1 - j0;
  // The products land in float32: in y itself when it is float32, else in scratch.
  float* acc = is_float ? reinterpret_cast<float*>(y) + j0 : scratch;
  const int64_t lda = is_float ? ldy : n;
  if constexpr (!is_float) {  // (bf16 rows: bf16 weights)
    if (x.bf16 != nullptr) {
      skinny_gemm_nt_bf16_dot(x.bf16, rows, K, w, K, K, j0, j1, acc, lda);
      x.f = nullptr;
    }
  }
  if (x.f != nullptr) {  // float32 products, bf16 weights widened: 512-bit vectors where the CPU has AVX-512
    if (avx512_enabled())
      skinny_gemm_nt_avx512(x.f, rows, K, w, K, K, j0, j1, acc, lda);
    else
      skinny_gemm_nt(x.f, rows, K, w, K, K, j0, j1, acc, lda);
  }
  for (int64_t r = 0; r < rows; ++r) {  // the bias, then one rounding to y's dtype
    for (int64_t j = 0; j < n; ++j) {
      const float v = bias == nullptr ? acc[r * lda + j] : acc[r * lda + j] + static_cast<float>(bias[j0 + j]);
      y[r * ldy + j0 + j] = static_cast<scalar_t>(v);
    }
  }
}

template void linear_columns<float>(StreamedRows, int64_t, int64_t, const float*, const float*, int64_t, int64_t,
                                    float*, int64_t, float*);
template void linear_columns<c10::BFloat16>(StreamedRows, int64_t, int64_t, const c10::BFloat16*,
                                            const c10::BFloat16*, int64_t, int64_t, c10::BFloat16*, int64_t, float*);
template void linear_columns<float, c10::BFloat16>(StreamedRows, int64_t, int64_t, const c10::BFloat16*, const float*,
                                                   int64_t, int64_t, float*, int64_t, float*);

namespace {

// torch's oneDNN linear (mkldnn::_linear_pointwise, float32 IEEE arithmetic, the weight as it is),
// where torch was built with oneDNN and JAKIRO_CPU_ONEDNN is not 0. On a prompt's projections it
// ran 1.1-1.6x MKL's sgemm (2-core AMD EPYC, Zen 4: 167-212 against 128-184 GFLOP/s).
std::optional<c10::OperatorHandle> onednn_linear() {
  static const std::optional<c10::OperatorHandle> op = []() -> std::optional<c10::OperatorHandle> {
    if (env_disabled("JAKIRO_CPU_ONEDNN") || !at::hasMKLDNN()) return std::nullopt;
    return c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  }();
  return op;
}

// x [M, K] float32 times W^T (+ b) by the fastest product for many rows.
at::Tensor many_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto op = onednn_linear();
  if (!op.has_value() || x.scalar_type() != at::kFloat) return at::linear(x, weight, bias);
  const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  torch::jit::Stack stack{x.contiguous(), weight.contiguous(), b, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::optional<std::string>(std::string(""))};
  op->callBoxed(&stack);
  return stack.back().toTensor();
}

// x float32 times a packed quantized W^T (+ b), any number of rows: the rows quantized once, then
// each task a block of output columns for every row (cpu/quantized.h; no BLAS path: every row
// is computed alike, a prompt's too).
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = weight.size(0) * kQuantLanes;
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out.view(out_shape);
  QuantizedRows rows;
  rows.quantize(x2.data_ptr<float>(), M, K);
  const auto w = weight.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const QuantFormat format = quant_format_of_chunk(weight.size(2));
  at::parallel_for(0, N / kQuantLanes, 1, [&](int64_t g0, int64_t g1) {
    quantized_columns(rows, w.data_ptr<uint8_t>(), format, b.defined() ? b.data_ptr<float>() : nullptr,
                      g0 * kQuantLanes, g1 * kQuantLanes, out.data_ptr<float>(), N);
  });
  return out.view(out_shape);
}

}  // namespace

bool onednn_linear_enabled() { return onednn_linear().has_value(); }

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_linear(x, weight, bias, /*bf16_weights=*/true);
  if (weight.scalar_type() == at::kByte) return quantized_linear(x, weight, bias);
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
  if (M == 0 || K == 0) return at::linear(x, weight, bias);
  // float32 x with bf16 weights (check_weight_dtype): the weights widened for BLAS, read as they
  // are when streamed.
  const bool widened_weights = weight.scalar_type() != x.scalar_type();
  if (blas && M > kLinearStreamRows && !short_sequences) {
    return many_rows_linear(x2, widened_weights ? weight.to(at::kFloat) : weight, bias).view(out_shape);
  }

  auto w = weight.contiguous();
  auto out = at::empty({M, N}, x.options());
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const bool dot = !is_float && bf16_dot_enabled();  // native bf16 dot products (AVX512-BF16)
  const auto xs = dot ? x2.contiguous() : x2.to(at::kFloat).contiguous();
  StreamedRows rows_in;
  if (dot)
    rows_in.bf16 = reinterpret_cast<const c10::BFloat16*>(xs.data_ptr());
  else
    rows_in.f = xs.data_ptr<float>();
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  // Each task owns a block of output columns for every row: W is read once, by one thread.
  auto stream = [&](auto* pw, auto* pb, auto* po) {
    for (int64_t m0 = 0; m0 < M; m0 += kLinearStreamRows) {
      const int64_t rows = std::min(kLinearStreamRows, M - m0);
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        const int64_t j0 = b0 * kColumnBlock, j1 = std::min(N, b1 * kColumnBlock);
        std::vector<float> scratch(is_float ? 0 : rows * (j1 - j0));
        linear_columns(rows_in.at(m0 * K), rows, K, pw, pb, j0, j1, po + m0 * N, N, scratch.data());
      });
    }
  };
  if (widened_weights) {
    stream(w.data_ptr<c10::BFloat16>(), b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>());
    return out.view(out_shape);
  }
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "linear_cpu", [&] {
    stream(w.data_ptr<scalar_t>(), b.defined() ? b.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>());
  });
  return out.view(out_shape);
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace jakiro::cpu
