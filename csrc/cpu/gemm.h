// Row-major float32 GEMM on raw buffers through ATen's mm (MKL/oneDNN/OpenBLAS, whichever
// torch was built with). Called from inside at::parallel_for, where it runs single-threaded.
#pragma once

#include <ATen/ATen.h>

namespace jakiro::cpu {

// Wraps caller-owned float memory as a [rows, cols] tensor with row stride `ld` (no copy).
inline at::Tensor float_view(const float* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<float*>(data), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

// c[m, n] (+)= a[m, k] @ b[n, k]^T, all row-major with leading dimensions lda, ldb, ldc.
inline void gemm_nt(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
                    int64_t n, int64_t k, bool accumulate) {
  auto C = float_view(c, m, n, ldc);
  auto A = float_view(a, m, k, lda);
  auto Bt = float_view(b, n, k, ldb).t();
  if (accumulate) {
    C.addmm_(A, Bt);
  } else {
    at::mm_out(C, A, Bt);
  }
}

// c[m, n] (+)= a[m, k] @ b[k, n], all row-major.
inline void gemm_nn(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t m,
                    int64_t n, int64_t k, bool accumulate) {
  auto C = float_view(c, m, n, ldc);
  auto A = float_view(a, m, k, lda);
  auto B = float_view(b, k, n, ldb);
  if (accumulate) {
    C.addmm_(A, B);
  } else {
    at::mm_out(C, A, B);
  }
}

}  // namespace jakiro::cpu
