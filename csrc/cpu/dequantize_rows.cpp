// jakiro::dequantize_rows on the CPU: rows of a packed quantized weight (a quantized embedding
// table's lookup) dequantized as GGML does, with jakiro/quant.h's arithmetic (the GPU kernel's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "jakiro/quant.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

// Row `row` of the packed weight (`blocks` chunks a group) into out[blocks * 32].
template <QuantFormat F>
void dequantize_row(const uint8_t* packed, int64_t blocks, int64_t row, float* out) {
  constexpr int64_t chunk_bytes = kQuantLanes * quant_block_bytes(F);
  const int64_t lane = row % kQuantLanes;
  const uint8_t* chunk = packed + row / kQuantLanes * blocks * chunk_bytes;
  for (int64_t b = 0; b < blocks; ++b, chunk += chunk_bytes, out += kQuantBlock) {
    const float d = quant_scale<F>(chunk, lane), m = quant_min<F>(chunk, lane);
    for (int64_t e = 0; e < kQuantBlock; ++e)
      out[e] = quant_value<F>(d, m, quant_code<F>(chunk + quant_scale_bytes(F), lane, e));
  }
}

at::Tensor dequantize_rows_cpu(const at::Tensor& packed, const at::Tensor& rows) {
  const int64_t K = check_dequantize_rows(packed, rows);
  const auto r = rows.contiguous();
  auto shape = rows.sizes().vec();
  shape.push_back(K);
  auto out = at::empty(shape, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t* ids = r.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  const int64_t blocks = packed.size(1);
  const QuantFormat format = quant_format_of_chunk(packed.size(2));
  // A row is a few KB of output: a decoding step's few rows run inline, a prompt's in parallel.
  at::parallel_for(0, r.numel(), 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      switch (format) {
        case QuantFormat::kQ4_0: dequantize_row<QuantFormat::kQ4_0>(w, blocks, ids[i], y + i * K); break;
        case QuantFormat::kQ4_1: dequantize_row<QuantFormat::kQ4_1>(w, blocks, ids[i], y + i * K); break;
        default: dequantize_row<QuantFormat::kQ8_0>(w, blocks, ids[i], y + i * K); break;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("dequantize_rows", &dequantize_rows_cpu); }

}  // namespace jakiro::cpu
