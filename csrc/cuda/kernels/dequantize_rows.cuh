// GPU kernel of jakiro::dequantize_rows: rows of a packed quantized weight dequantized as GGML
// does, with jakiro/quant.h's arithmetic (the CPU kernel's: the same bits). One thread per output
// weight, grid-striding; a row index outside the weight reports kBadRows and gives NaN weights.
#pragma once

#include "cuda/device.h"
#include "jakiro/quant.h"

namespace jakiro::gpu {

struct DequantizeRowsParams {
  const uint8_t* packed;  // [groups, blocks, 16 B], contiguous
  const int64_t* rows;    // [n]
  float* out;             // [n, blocks * 32]
  int64_t n, groups, blocks;
  QuantFormat format;
  int32_t* errors;  // the device's error word
};

constexpr int kDequantizeRowsThreads = 256;

template <QuantFormat F>
__global__ void dequantize_rows_kernel(DequantizeRowsParams p) {
  constexpr int64_t chunk_bytes = kQuantLanes * quant_block_bytes(F);
  const int64_t K = p.blocks * kQuantBlock, total = p.n * K;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = p.rows[i / K], k = i % K;
    if (row < 0 || row >= p.groups * kQuantLanes) {
      if (k == 0) report_error(p.errors, kBadRows);
      p.out[i] = quiet_nan();
      continue;
    }
    const uint8_t* chunk = p.packed + (row / kQuantLanes * p.blocks + k / kQuantBlock) * chunk_bytes;
    p.out[i] = quant_weight<F>(chunk, row % kQuantLanes, k % kQuantBlock);
  }
}

inline void launch_dequantize_rows(const DequantizeRowsParams& p, cudaStream_t stream) {
  const int64_t total = p.n * p.blocks * kQuantBlock;
  if (total == 0) return;
  const auto grid = static_cast<unsigned>(
      ceil_div(total, kDequantizeRowsThreads) < 65535 ? ceil_div(total, kDequantizeRowsThreads) : 65535);
  switch (p.format) {
    case QuantFormat::kQ4_0:
      JAKIRO_LAUNCH(grid, kDequantizeRowsThreads, 0, stream, dequantize_rows_kernel<QuantFormat::kQ4_0>)(p);
      break;
    case QuantFormat::kQ4_1:
      JAKIRO_LAUNCH(grid, kDequantizeRowsThreads, 0, stream, dequantize_rows_kernel<QuantFormat::kQ4_1>)(p);
      break;
    default:
      JAKIRO_LAUNCH(grid, kDequantizeRowsThreads, 0, stream, dequantize_rows_kernel<QuantFormat::kQ8_0>)(p);
      break;
  }
}

}  // namespace jakiro::gpu
