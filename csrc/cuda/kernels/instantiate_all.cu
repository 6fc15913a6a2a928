// Every GPU kernel instantiated for every element type, with no torch: the translation unit of
// the kernel-only builds (scripts/check_hip_build.sh compiles it, hipified, with hipcc for AMD
// GPUs, where no ROCm build of torch is at hand for the glue).
#include "cuda/kernels/compact_kv.cuh"
#include "cuda/kernels/contrastive_topk.cuh"
#include "cuda/kernels/dequantize_rows.cuh"
#include "cuda/kernels/linear.cuh"
#include "cuda/kernels/linear_wmma.cuh"  // (empty on HIP: the tensor-core kernels are CUDA-only)
#include "cuda/kernels/mlp_heads.cuh"
#include "cuda/kernels/moe_top2.cuh"
#include "cuda/kernels/merge_attention_states.cuh"
#include "cuda/kernels/rms_norm.cuh"
#include "cuda/kernels/rope_kv_write.cuh"
#include "cuda/kernels/silu_mul.cuh"
#include "cuda/kernels/tree_attention.cuh"
#include "cuda/kernels/tree_attention_wmma.cuh"  // (likewise)
#include "cuda/kernels/verify_tree.cuh"

namespace jakiro::gpu {

#define JAKIRO_INSTANTIATE_FOR(T)                                                                   \
  template void launch_merge_attention_states<T>(const MergeParams&, cudaStream_t);                \
  template void launch_tree_attention_partial<T>(const TreeAttentionParams<T>&, cudaStream_t);    \
  template void launch_linear<T>(const LinearParams&, cudaStream_t);                               \
  template void launch_mlp_heads<T>(const MlpHeadsParams&, cudaStream_t);                          \
  template void launch_rms_norm<T>(const RmsNormParams&, cudaStream_t);                           \
  template void launch_rope_kv_write<T>(const RopeKvParams&, cudaStream_t);                       \
  template void launch_silu_mul<T>(const SiluMulParams&, cudaStream_t);                           \
  template void launch_moe_top2<T>(const MoeParams&, cudaStream_t);                               \
  template void launch_contrastive_topk<T>(const ContrastiveParams&, cudaStream_t);               \
  template void launch_verify_tree<T>(const VerifyParams&, cudaStream_t);

JAKIRO_INSTANTIATE_FOR(float)
JAKIRO_INSTANTIATE_FOR(bf16)

}  // namespace jakiro::gpu
