// Torch glue of GPU tree attention: tree_attention_partial (kernels/tree_attention.cuh on CUDA
// cores, kernels/tree_attention_wmma.cuh on tensor cores for bf16 trees of >= 16 query rows per
// KV head) and tree_attention = partial pass + merge (kernels/merge_attention_states.cuh).
#include <algorithm>
#include <climits>
#include <cmath>

#include "cuda/kernels/merge_attention_states.cuh"
#include "cuda/kernels/tree_attention.cuh"
#include "cuda/kernels/tree_attention_wmma.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

// Splits shorter than this many keys cost more in launch and merge than they win.
constexpr int64_t kMinSplitLen = 256;
// Blocks of the partial kernel resident per multiprocessor (128 threads, ~128 registers each):
// the split count aims at filling them all.
constexpr int64_t kBlocksPerMultiprocessor = 4;

// Whether this call runs on tensor cores: the shape qualifies and the device may (launch.h). With
// fixed splits every row count qualifies, so that a tree and its tokens' one-token steps run the
// same kernel (a row's bits are then the same in both).
bool use_tensor_cores(const TreeAttentionShape& sh, const at::Tensor& q, int64_t split_len) {
#if defined(JAKIRO_HAS_WMMA)
  return tree_attention_uses_tensor_cores(q.scalar_type() == at::kBFloat16, sh.head_dim,
                                          sh.tree_len * (sh.q_heads / sh.kv_heads), split_len > 0) &&
         tensor_cores_enabled(q);
#else
  (void)sh;
  (void)q;
  (void)split_len;
  return false;
#endif
}

template <typename kv_t>
void launch_partial(const TreeAttentionParams<kv_t>& p, bool tensor_cores, cudaStream_t stream) {
#if defined(JAKIRO_HAS_WMMA)
  if constexpr (std::is_same_v<kv_t, bf16>) {
    if (tensor_cores) return launch_tree_attention_partial_wmma(p, stream);
  }
#endif
  (void)tensor_cores;
  launch_tree_attention_partial(p, stream);
}

std::tuple<at::Tensor, at::Tensor> partial(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                           const at::Tensor& tree_mask, int64_t num_splits,
                                           std::optional<double> scale, int64_t split_len) {
  const auto sh = check_tree_attention(op, q, k_cache, v_cache, prefix_lens, tree_mask);
  TORCH_CHECK(num_splits >= 1, op, ": num_splits must be >= 1, got ", num_splits);
  TORCH_CHECK(sh.head_dim <= kAttnMaxHeadDim, op, ": the GPU kernel supports head dims up to ", kAttnMaxHeadDim,
              ", got ", sh.head_dim);
  TORCH_CHECK(sh.batch * sh.kv_heads <= 65535, op, ": the GPU kernel supports batch x KV heads up to 65535 (a grid ",
              "dimension), got ", sh.batch, " x ", sh.kv_heads);
  // Fixed splits gather a row's tree keys into shared memory (at most kFixedSplitMaxTree) and keep
  // its near run's keys as int32.
  TORCH_CHECK(split_len == 0 || (sh.tree_len <= kFixedSplitMaxTree && sh.capacity <= INT32_MAX), op,
              ": fixed splits serve trees of at most ", kFixedSplitMaxTree, " tokens in caches of at most ", INT32_MAX,
              " positions, got ", sh.tree_len, " tokens and ", sh.capacity, " positions");
  const DeviceScope device(q);
  auto qc = q.contiguous();
  auto lens = prefix_lens.contiguous();
  auto mask = tree_mask.contiguous();
  auto out = at::empty({sh.batch, sh.tree_len, sh.q_heads, num_splits, sh.head_dim}, q.options().dtype(at::kFloat));
  auto lse = at::empty({sh.batch, sh.tree_len, sh.q_heads, num_splits}, q.options().dtype(at::kFloat));
  const float sc = attention_scale(op, scale, sh.head_dim);
  const bool tensor_cores = use_tensor_cores(sh, q, split_len);
  JAKIRO_DISPATCH_FLOAT_BF16(q.scalar_type(), "tree_attention_partial_gpu", [&] {
    using kv_t = device_t<scalar_t>;
    const TreeAttentionParams<kv_t> p{device_ptr<scalar_t>(qc),
                                      device_ptr<scalar_t>(k_cache),
                                      device_ptr<scalar_t>(v_cache),
                                      lens.data_ptr<int64_t>(),
                                      mask.data_ptr<int64_t>(),
                                      out.data_ptr<float>(),
                                      lse.data_ptr<float>(),
                                      sh.batch,
                                      sh.tree_len,
                                      sh.q_heads,
                                      sh.kv_heads,
                                      sh.head_dim,
                                      num_splits,
                                      mask.size(2),
                                      k_cache.stride(0),
                                      k_cache.stride(1),
                                      sc,
                                      sh.capacity,
                                      error_word(q),
                                      /*row_block0=*/0,
                                      split_len};
    launch_partial(p, tensor_cores, device.stream());
  });
  check_launch();
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> tree_attention_partial_gpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                               const at::Tensor& v_cache,
                                                               const at::Tensor& prefix_lens,
                                                               const at::Tensor& tree_mask, int64_t num_splits,
                                                               std::optional<double> scale) {
  return partial("jakiro::tree_attention_partial", q, k_cache, v_cache, prefix_lens, tree_mask, num_splits, scale,
                 /*split_len=*/0);
}

std::tuple<at::Tensor, at::Tensor> tree_attention_gpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                      const at::Tensor& v_cache, const at::Tensor& prefix_lens,
                                                      const at::Tensor& tree_mask, std::optional<double> scale,
                                                      std::optional<int64_t> num_splits) {
  // The sequences' lengths live on the device, so the split count is sized by the cache capacity
  // (no device-to-host copy). A decoding step or a draft tree: fixed splits of each row's run
  // (its bits those of its one-token step); splits past a sequence's run are empty, and the
  // merge does not read them. A longer run (a prompt's chunk): even parts, shorter for shorter sequences.
  int64_t splits, split_len = 0;
  if (num_splits.has_value()) {
    splits = *num_splits;
  } else if (q.dim() != 4 || k_cache.dim() != 4) {
    splits = 1;  // the shape check reports it
  } else if (q.size(1) <= kFixedSplitMaxTree) {
    split_len = kFixedSplitLen;
    splits = std::max<int64_t>(1, ceil_div(k_cache.size(2), kFixedSplitLen));
  } else {
    splits = default_num_splits(q.size(0), k_cache.size(1), k_cache.size(2),
                                multiprocessor_count() * kBlocksPerMultiprocessor, kMinSplitLen);
  }
  auto [out_p, lse_p] =
      partial("jakiro::tree_attention", q, k_cache, v_cache, prefix_lens, tree_mask, splits, scale, split_len);
  const DeviceScope device(q);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  auto out = at::empty({B, T, H, D}, q.options());
  auto lse = at::empty({B, T, H}, q.options().dtype(at::kFloat));
  const MergeParams p{out_p.data_ptr<float>(), lse_p.data_ptr<float>(), out.data_ptr(), lse.data_ptr<float>(),
                      B * T * H, splits, D};
  JAKIRO_DISPATCH_FLOAT_BF16(q.scalar_type(), "tree_attention_gpu", [&] {
    launch_merge_attention_states<device_t<scalar_t>>(p, device.stream());
  });
  check_launch();
  return {out, lse};
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) {
  m.impl("tree_attention_partial", &tree_attention_partial_gpu);
  m.impl("tree_attention", &tree_attention_gpu);
}

}  // namespace jakiro::gpu
