// Torch glue of the GPU jakiro::dequantize_rows (kernel: kernels/dequantize_rows.cuh).
#include "cuda/kernels/dequantize_rows.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

at::Tensor dequantize_rows_gpu(const at::Tensor& packed, const at::Tensor& rows) {
  const int64_t K = check_dequantize_rows(packed, rows);
  const DeviceScope scope(packed);
  const auto r = rows.contiguous();
  auto shape = rows.sizes().vec();
  shape.push_back(K);
  auto out = at::empty(shape, packed.options().dtype(at::kFloat));
  const DequantizeRowsParams p{packed.data_ptr<uint8_t>(), r.data_ptr<int64_t>(), out.data_ptr<float>(), r.numel(),
                               packed.size(0),           packed.size(1),        quant_format_of_chunk(packed.size(2)),
                               error_word(packed)};
  launch_dequantize_rows(p, scope.stream());
  check_launch();
  return out;
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("dequantize_rows", &dequantize_rows_gpu); }

}  // namespace jakiro::gpu
