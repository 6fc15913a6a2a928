// bf16 x bf16 products with the CPU's native bf16 dot instructions (AVX512-BF16 vdpbf16ps:
// pairs of bf16 products accumulated into float32 lanes), chosen at run time. The kernel is
// compiled for those instructions whatever the build's -march (cpu/bf16_dot.cpp), and runs
// only where the CPU has them; elsewhere, and when JAKIRO_CPU_BF16_DOT=0 (to test or compare
// the fallback), bf16 weights are widened to float32 (cpu/skinny_gemm.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace jakiro::cpu {

// Does this CPU run native bf16 dot products, and are they enabled (JAKIRO_CPU_BF16_DOT != 0)?
bool bf16_dot_enabled();

// Y[m, j - j0] = X[m, :] . W[j, :] for m < M, j in [j0, j1), X and W bf16 (row strides ldx,
// ldw), Y float32 (row stride ldy). Like skinny_gemm_nt: W read once, each Y[m, j] computed in
// the same order whatever M. Only call when bf16_dot_enabled().
void skinny_gemm_nt_bf16_dot(const c10::BFloat16* X, int64_t M, int64_t ldx, const c10::BFloat16* W, int64_t ldw,
                             int64_t K, int64_t j0, int64_t j1, float* Y, int64_t ldy);

}  // namespace jakiro::cpu
