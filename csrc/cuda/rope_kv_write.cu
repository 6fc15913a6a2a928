// Torch glue of the GPU jakiro::rope_kv_write (kernel: kernels/rope_kv_write.cuh).
#include "cuda/kernels/rope_kv_write.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

at::Tensor rope_kv_write_gpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& kv_cache, const at::Tensor& lengths) {
  const auto s = check_rope_kv_write(qkv, cos, sin, kv_cache, lengths);
  const DeviceScope scope(qkv);
  auto x = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), lens = lengths.contiguous();
  auto q = at::empty({s.batch, s.tokens, s.q_heads, s.head_dim}, x.options());
  JAKIRO_DISPATCH_FLOAT_BF16(qkv.scalar_type(), "rope_kv_write_gpu", [&] {
    const RopeKvParams p{x.data_ptr(), c.data_ptr(), sn.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                         lens.data_ptr<int64_t>(), q.data_ptr(), s.batch, s.tokens, s.q_heads, s.kv_heads,
                         s.head_dim, kv_cache.stride(1), kv_cache.stride(2), s.capacity, error_word(qkv)};
    launch_rope_kv_write<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return q;
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("rope_kv_write", &rope_kv_write_gpu); }

}  // namespace jakiro::gpu
