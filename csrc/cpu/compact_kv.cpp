// CPU kernel of KV compaction: after verification, move each sequence's accepted tree entries
// (tree indices path[b, :path_len[b]], increasing) to positions prefix_lens[b] + 0, 1, ...
// of the cache, in place. Destinations never pass their sources (path[j] >= j), so copying in
// increasing j is safe.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "ops.h"

namespace jakiro::cpu {
namespace {

void compact_kv_cpu(const at::Tensor& cache, const at::Tensor& prefix_lens, const at::Tensor& path,
                    const at::Tensor& path_len) {
  check_compact_kv(cache, prefix_lens, path, path_len);
  const int64_t B = cache.size(-4), H = cache.size(-3), S = cache.size(-2), D = cache.size(-1);
  const int64_t outer = cache.numel() / std::max<int64_t>(1, B * H * S * D);
  const int64_t row_bytes = D * cache.element_size();
  auto pa = path.contiguous(), pl = prefix_lens.contiguous(), n = path_len.contiguous();
  const int64_t* pp = pa.data_ptr<int64_t>();
  const int64_t* pre = pl.data_ptr<int64_t>();
  const int64_t* len = n.data_ptr<int64_t>();
  const int64_t width = path.size(1);
  char* base = static_cast<char*>(cache.data_ptr());
  // A step moves a few rows per (layer, sequence, head): parallelise only past ~256 KiB of copies,
  // below that waking the thread pool costs more than it saves.
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, len[b]);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (max_len * row_bytes));
  at::parallel_for(0, outer * B * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t slab = begin; slab < end; ++slab) {  // slab = (outer index, b, h)
      const int64_t b = (slab / H) % B;
      char* rows = base + slab * S * row_bytes;
      for (int64_t j = 0; j < len[b]; ++j) {
        const int64_t src = pre[b] + pp[b * width + j], dst = pre[b] + j;
        if (src != dst) std::memcpy(rows + dst * row_bytes, rows + src * row_bytes, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("compact_kv", &compact_kv_cpu); }

}  // namespace jakiro::cpu
