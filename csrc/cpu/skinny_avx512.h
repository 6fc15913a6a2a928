// The skinny products (cpu/skinny_gemm.h) on 512-bit vectors, chosen at run time: float32 with
// fused multiply-adds on 16 lanes (bf16 weights widened to float32 in registers), bf16 x bf16
// with the CPU's native bf16 dot products (AVX512-BF16 vdpbf16ps: pairs of bf16 products
// accumulated into float32 lanes). The kernels
// are compiled for those instructions whatever the build's -march (cpu/skinny_avx512_*.cpp)
// and run only where the CPU has them; elsewhere, and when JAKIRO_CPU_AVX512=0 or
// JAKIRO_CPU_BF16_DOT=0 (to test or compare the fallbacks), the 256-bit kernels of
// cpu/skinny_gemm.h run, bf16 weights widened to float32.
//
// Like skinny_gemm_nt, W is read once and each Y[m, j] is computed in the same order whatever M:
// 16 lane accumulators over k (the tail masked to zeros), then a fixed pairwise reduction.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define JAKIRO_HAVE_AVX512_KERNELS 1
#endif

namespace jakiro::cpu {

// W rows x X rows of a register tile: 4 x 6 accumulators of the 32 vector registers (measured
// on an Intel Xeon against 1x16, 2x12, 3x8, 5x5, 6x4 and 4x7 at 4-32 rows on the default model's
// weights).
constexpr int kAvx512Rows = 4;
constexpr int kAvx512Cols = 6;
// On AMD CPUs the float32 tiles are 2 x 8: two weight streams at a time instead of four, which
// Zen 4's prefetcher follows better (a forward of the default model of 2-60 tokens 4-7% faster
// there, 1-row steps aside; bf16 dot products showed no difference and keep 4 x 6).
constexpr int kAmdFp32Rows = 2;
constexpr int kAmdFp32Cols = 8;
// On AMD CPUs up to this many X rows read W as one stream, a W row at a time (avx512::WeightStream).
constexpr int kAmdOneStreamRows = 5;

// Is this CPU AMD's? There the skinny products take the shapes measured on AMD EPYCs (up to
// kAmdOneStreamRows X rows as one weight stream, kAmdFp32Rows x kAmdFp32Cols float32 tiles);
// elsewhere those measured on an Intel Xeon (4-row tiles, which read a decoding step near its read floor, and the next tile
// asked for over the passes of many rows: avx512::WeightStream).
bool amd_cpu();

// Is the environment variable `name` set to 0 (a CPU kernel choice turned off)?
bool env_disabled(const char* name);

// Does this CPU run the 512-bit float32 kernel, and is it enabled (JAKIRO_CPU_AVX512 != 0)?
bool avx512_enabled();

// Does this CPU run native bf16 dot products, and are they enabled (the above, and
// JAKIRO_CPU_BF16_DOT != 0)?
bool bf16_dot_enabled();

// Y[m, j - j0] = X[m, :] . W[j, :] for m < M, j in [j0, j1), Y float32 (row stride ldy), X and W
// (row strides ldx, ldw) float32 / bf16. Only call when avx512_enabled() / bf16_dot_enabled().
void skinny_gemm_nt_avx512(const float* X, int64_t M, int64_t ldx, const float* W, int64_t ldw, int64_t K,
                           int64_t j0, int64_t j1, float* Y, int64_t ldy);
void skinny_gemm_nt_avx512(const float* X, int64_t M, int64_t ldx, const c10::BFloat16* W, int64_t ldw, int64_t K,
                           int64_t j0, int64_t j1, float* Y, int64_t ldy);  // W widened to float32
void skinny_gemm_nt_bf16_dot(const c10::BFloat16* X, int64_t M, int64_t ldx, const c10::BFloat16* W, int64_t ldw,
                             int64_t K, int64_t j0, int64_t j1, float* Y, int64_t ldy);

}  // namespace jakiro::cpu
