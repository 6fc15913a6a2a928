// Torch glue of the GPU fused (contrastive) LM head (kernels: kernels/contrastive_topk.cuh).
#include "cuda/kernels/contrastive_topk.cuh"
#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

// Float32 logits held at once by the scratch (rows x V); more rows go in chunks.
constexpr int64_t kLogitsScratchElems = int64_t{1} << 26;

std::tuple<at::Tensor, at::Tensor> contrastive_topk_gpu(const at::Tensor& h_a, const std::optional<at::Tensor>& h_b,
                                                        const std::optional<at::Tensor>& contrast_weight,
                                                        const at::Tensor& lm_head, int64_t k) {
  check_contrastive_topk(h_a, h_b, contrast_weight, lm_head, k);
  const DeviceScope scope(h_a);
  const int64_t H = h_a.size(-1), V = lm_head.size(0);
  auto a = h_a.reshape({-1, H}).contiguous();
  const int64_t rows = a.size(0);
  at::Tensor b, w;
  if (h_b.has_value()) {
    b = h_b->reshape({-1, H}).contiguous();
    w = contrast_weight->reshape({-1, 2}).to(at::kFloat).contiguous();
  }
  auto lm = lm_head.contiguous();
  const auto f32 = a.options().dtype(at::kFloat);
  const int64_t scratch_rows = std::max<int64_t>(1, std::min<int64_t>(rows, kLogitsScratchElems / V));
  auto features = at::empty({rows, H}, f32);
  auto logits = at::empty({scratch_rows, V}, f32);
  auto lead = h_a.sizes().slice(0, h_a.dim() - 1).vec();
  lead.push_back(k);
  const int64_t splits = contrastive::split_count(V, k);
  // The split top-k's scratch (empty without a split).
  const int64_t split_rows = splits > 1 ? scratch_rows : 0;
  auto split_values = at::empty({split_rows, splits, k}, f32);
  auto split_indices = at::empty({split_rows, splits, k}, f32.dtype(at::kLong));
  auto split_stats = at::empty({2, split_rows, splits}, f32);
  auto logprobs = at::empty(lead, f32);
  auto ids = at::empty(lead, f32.dtype(at::kLong));
  const ContrastiveParams p{a.data_ptr(),
                            b.defined() ? b.data_ptr() : nullptr,
                            w.defined() ? w.data_ptr<float>() : nullptr,
                            lm.data_ptr(),
                            features.data_ptr<float>(),
                            logits.data_ptr<float>(),
                            logprobs.data_ptr<float>(),
                            ids.data_ptr<int64_t>(),
                            rows,
                            H,
                            V,
                            k,
                            scratch_rows,
                            splits,
                            split_values.data_ptr<float>(),
                            split_indices.data_ptr<int64_t>(),
                            split_stats[0].data_ptr<float>(),
                            split_stats[1].data_ptr<float>()};
  JAKIRO_DISPATCH_FLOAT_BF16(a.scalar_type(), "contrastive_topk_gpu", [&] {
    launch_contrastive_topk<device_t<scalar_t>>(p, scope.stream());
  });
  check_launch();
  return {logprobs, ids};
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("contrastive_topk", &contrastive_topk_gpu); }

}  // namespace jakiro::gpu
