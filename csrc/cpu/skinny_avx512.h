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
// On AMD's Zen 5 (CPU family 0x1A) and later up to this many X rows read W as one stream, a W row
// at a time (avx512::WeightStream); on earlier AMD CPUs one row.
constexpr int kZen5Family = 0x1A;
constexpr int kZen5OneStreamRows = 5;

// How the 512-bit products read W (avx512::skinny), per CPU: measured on the default model's
// weights, whole forwards.
struct WeightStream {
  // Up to this many X rows read W a row after the other instead of in NR-row tiles, every X row
  // in one pass: one sequential stream, which the hardware prefetcher follows. An AMD EPYC, Zen 4:
  // one row (a decoding step) 13% faster in bf16 and 7-9% in float32 than with the 4-row tiles,
  // whose interleaved streams it follows less well; 4 and 16 rows 1.5x slower one row at a time
  // than in tiles. Zen 5: the products of a forward's weights at 2-4 rows 1.30x the one-row time
  // in 2 x 8 tiles against 0.99-1.09x so; a forward of 2 / 3 / 4 / 5 tokens 0.80 / 0.87 / 0.85 /
  // 0.96x the time in float32, 0.81 / 0.85 / 0.98 / 0.93x in bf16; 6 rows 1.05-1.10x (slower:
  // the arithmetic no longer hides under the reading). 0: never (an Intel Xeon: one row 6% slower).
  int64_t one_stream_rows;
  // The one stream asks for W kFarPrefetchBytes ahead instead of kNearPrefetchBytes (Zen 5: a
  // forward of 1-5 tokens 0.95-0.97x the time, fp32 and bf16; 8 and 16 KB no better, 1 KB worse.
  // Zen 4: 2 KB neither helped nor hurt against none, 8 KB hurt).
  bool far_ahead;
  // Where the X rows take more than one pass over a tile's W rows, every pass asks for a share of
  // the next tile's rows (spread over its k steps, in proportion to its X rows) instead of each
  // pass asking for the same bytes 8 KB ahead: memory is then read during the later passes,
  // which otherwise only compute on W in L1 (an Intel Xeon, float32: a forward of 8, 12 and 16
  // tokens 0.92-0.95x, 0.88-0.89x and 0.86-0.90x the time, bf16 0.95-0.97x; one pass (up to 6
  // rows) is faster with the 8 KB, spread there 1.04-1.07x. An AMD EPYC measured a spread slower).
  bool next_tile_over_passes;
  // float32 register tiles of kAmdFp32Rows x kAmdFp32Cols instead of kAvx512Rows x kAvx512Cols.
  bool amd_tiles;
};

// The stream measured best on this CPU: on AMD's Zen 5 and later one stream up to
// kZen5OneStreamRows rows, far ahead; on earlier AMD CPUs one stream for one row; elsewhere the
// spread, 4 x 6 tiles. JAKIRO_CPU_WEIGHT_STREAM=zen5, zen4 or intel names one of them instead
// (each gives the same bits: the tests run them all on any CPU). Read once.
WeightStream weight_stream();
// Its name: zen5, zen4 or intel.
const char* weight_stream_name();

// Is this CPU AMD's? (weight_stream() takes the shapes measured on AMD EPYCs there.)
bool amd_cpu();
// This CPU's family as CPUID reports it (base + extended family: AMD's Zen 3/4 0x19, Zen 5 0x1A).
int cpu_family();

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
// The tree attention's products for few query rows (cpu/attention_avx512.cpp), D a multiple of 16
// and at most kMaxAttentionDim. s[r * lds + j] = q[r, :] . k[j, :] for r < rows, j < n (q [rows,
// D], k [n, D]: each score 16 lane sums over d in order, then reduce_lanes's tree, whatever rows
// and n); acc[r, :] += sum_j p[r * ldp + j] v[j, :] (each element a chain of fused multiply-adds over
// j in order, whatever rows: a run of keys split over two calls gives the bits of one call). Only
// call when avx512_enabled().
constexpr int64_t kMaxAttentionDim = 256;
void attention_scores_avx512(const float* q, int64_t rows, const float* k, int64_t n, int64_t D, float* s,
                             int64_t lds);
void attention_scores_avx512(const float* q, int64_t rows, const c10::BFloat16* k, int64_t n, int64_t D, float* s,
                             int64_t lds);  // k widened to float32 in registers: the scores of its float32 values
void attention_pv_avx512(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t D,
                         float* acc);
void attention_pv_avx512(const float* p, int64_t ldp, int64_t rows, int64_t n, const c10::BFloat16* v, int64_t D,
                         float* acc);  // v widened to float32 in registers
void skinny_gemm_nt_bf16_dot(const c10::BFloat16* X, int64_t M, int64_t ldx, const c10::BFloat16* W, int64_t ldw,
                             int64_t K, int64_t j0, int64_t j1, float* Y, int64_t ldy);

}  // namespace jakiro::cpu
