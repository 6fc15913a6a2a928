// Row-major float32 GEMM on raw buffers through ATen's mm (MKL/oneDNN/OpenBLAS, whichever
// torch was built with). Called from inside at::parallel_for, where it runs single-threaded.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"

namespace jakiro::cpu {

// Wraps caller-owned float memory as a [rows, cols] tensor with row stride `ld` (no copy).
inline at::Tensor float_view(const float* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<float*>(data), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

// c[m, n] = a[m, k] @ b[n, k]^T, all row-major with leading dimensions lda, ldb, ldc.
inline void gemm_nt(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
                    int64_t n, int64_t k) {
  auto C = float_view(c, m, n, ldc);
  at::mm_out(C, float_view(a, m, k, lda), float_view(b, n, k, ldb).t());
}

// c[m, n] += a[m, k] @ b[k, n], all row-major.
inline void gemm_nn_accumulate(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                               int64_t m, int64_t n, int64_t k) {
  float_view(c, m, n, ldc).addmm_(float_view(a, m, k, lda), float_view(b, k, n, ldb));
}

// Rows of X from which a float32 product goes to BLAS: below it, streaming the weight once
// (skinny_gemm_nt) wins; above it, BLAS's register blocking does (measured on the MoE block).
constexpr int64_t kBlasRows = 16;

// Y[m, j - j0] = X[m, :] . W[j, :] (the activations times a weight in nn.Linear layout), by the
// faster of the two kernels for this shape and dtype. bf16 weights always stream (widening a
// whole weight for BLAS costs more than it saves).
template <typename scalar_t>
void rows_times_weight(const float* X, int64_t M, int64_t ldx, const scalar_t* W, int64_t ldw, int64_t K, int64_t j0,
                       int64_t j1, float* Y, int64_t ldy) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (M >= kBlasRows) {
      c10::InferenceMode guard;  // plain GEMM on caller-owned buffers
      gemm_nt(X, ldx, W + j0 * ldw, ldw, Y, ldy, M, j1 - j0, K);
      return;
    }
  }
  if (avx512_enabled()) return skinny_gemm_nt_avx512(X, M, ldx, W, ldw, K, j0, j1, Y, ldy);
  skinny_gemm_nt(X, M, ldx, W, ldw, K, j0, j1, Y, ldy);
}

}  // namespace jakiro::cpu
