// Torch glue of GPU KV compaction (kernel: kernels/compact_kv.cuh).
#include <algorithm>

#include "cuda/kernels/compact_kv.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

void compact_kv_gpu(const at::Tensor& cache, const at::Tensor& prefix_lens, const at::Tensor& path,
                    const at::Tensor& path_len) {
  check_compact_kv(cache, prefix_lens, path, path_len);
  const DeviceScope device(cache);
  const int64_t B = cache.size(-4), H = cache.size(-3), S = cache.size(-2), D = cache.size(-1);
  auto pl = prefix_lens.contiguous(), pa = path.contiguous(), n = path_len.contiguous();
  const CompactKvParams p{cache.data_ptr(),
                          pl.data_ptr<int64_t>(),
                          pa.data_ptr<int64_t>(),
                          n.data_ptr<int64_t>(),
                          cache.numel() / std::max<int64_t>(1, S * D),
                          B,
                          H,
                          S,
                          D * static_cast<int64_t>(cache.element_size()),
                          path.size(1),
                          error_word(cache)};
  launch_compact_kv(p, device.stream());
  check_launch();
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("compact_kv", &compact_kv_gpu); }

}  // namespace jakiro::gpu
