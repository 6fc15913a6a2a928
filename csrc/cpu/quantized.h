// Products with quantized weights (jakiro/quant.h: GGML's Q4_0, Q4_1, Q8_0, rows interleaved 16 at
// a time): the activations quantized per row to 8-bit blocks of 32 (as GGML's quantize_row_q8_0
// does), then integer dot products per block, scaled and summed in float32. Shared by jakiro::linear
// (linear.cpp) and the fused decoder layer (decoder_layer.cpp).
//
// Every output y[m, j] is one chain over the blocks in order, per block
//   t = float(sum_k cw * ca - offset * sum_k ca) * dw;  acc = fma(t, da, acc);  (Q4_1) acc = fma(mw, sa, acc)
// (cw, ca: the weights' and the activations' codes; dw, da their scales; mw the Q4_1 minimum; sa =
// da * sum_k ca), whatever the number of rows, the columns a thread takes and the instruction set
// (512-bit VNNI or portable C++): a token's logits are the same bits in a tree as alone.
#pragma once

#include <cstdint>
#include <vector>

#include "jakiro/quant.h"

namespace jakiro::cpu {

// Rows of activations quantized for the products: codes [rows, K] int8, and per row and block of
// 32 its scale (float16-rounded, as GGML stores it), its code sum and the scale times that sum.
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> sum;
  int64_t rows = 0, K = 0;
  // x [rows, K] float32 (K a multiple of 32, rows K apart). A block with a non-finite value gets
  // a NaN scale: its products are NaN, never a finite number made up.
  void quantize(const float* x, int64_t rows, int64_t K);
  // Room for `rows` rows of up to K values: quantize() then allocates nothing.
  void reserve(int64_t rows, int64_t K);
};

// y[m, j] = xq[m] . w[j] (+ bias[j]) for m < xq.rows, j0 <= j < j1 (multiples of 16, as the
// packed weight's groups), y's rows ldy apart; w: the packed weight [N / 16, K / 32, 16 B].
void quantized_columns(const QuantizedRows& xq, const uint8_t* w, QuantFormat format, const float* bias, int64_t j0,
                       int64_t j1, float* y, int64_t ldy);

// Whether the 512-bit VNNI kernel runs (the CPU has AVX512-VNNI, JAKIRO_CPU_AVX512 and
// JAKIRO_CPU_VNNI are not 0); else the portable one, same bits.
bool vnni_enabled();

}  // namespace jakiro::cpu
