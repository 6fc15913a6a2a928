// jakiro::linear's streamed path as one task's share (a block of output columns for a few rows),
// shared by the op (linear.cpp) and the CPU decoder layer, which splits its projections' columns
// between the threads of its own parallel region: each output is computed by the same code
// whichever calls it.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace jakiro::cpu {

// Output columns per unit of the split between threads (a multiple of the 4-row W block). Each
// thread takes one contiguous run of units and streams it in one call, so the unit only sets the
// balance: a 576-column projection splits 18/18 between two threads in units of 16, 5/4 in
// units of 64.
constexpr int64_t kColumnBlock = 16;

// Rows of x as the streamed products read them: float32 (bf16 rows widened first), or bf16 as
// they are where the CPU has AVX512-BF16 dot products (bf16_dot_enabled(); bf16 weights only).
struct StreamedRows {
  const float* f = nullptr;
  const c10::BFloat16* bf16 = nullptr;
  StreamedRows at(int64_t offset) const {
    return {f == nullptr ? nullptr : f + offset, bf16 == nullptr ? nullptr : bf16 + offset};
  }
};

// y[m, j] = x[m] . w[j] (+ bias[j]) for m < rows and j0 <= j < j1, rounded once to scalar_t; x's
// rows are K apart, w is [N, K] contiguous, y's rows ldy apart (column j at y[m * ldy + j]).
// scratch: rows * (j1 - j0) floats, used for a bf16 y only. Each y[m, j] takes the same path
// whatever rows, j0 and j1 are (cpu/skinny_gemm.h). weight_t: scalar_t, or bf16 beside a float32
// y (a bf16 checkpoint's weights read as they are, widened exactly: the bits of the float32 weights).
template <typename scalar_t, typename weight_t = scalar_t>
void linear_columns(StreamedRows x, int64_t rows, int64_t K, const weight_t* w, const scalar_t* bias, int64_t j0,
                    int64_t j1, scalar_t* y, int64_t ldy, float* scratch);

}  // namespace jakiro::cpu
