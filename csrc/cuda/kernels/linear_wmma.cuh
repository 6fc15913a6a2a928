// Batch-invariant tensor-core linear, y = x @ W^T (+ b), for bf16: every row's result is the
// same bits whatever the number of rows beside it, so a tree's verification forward gives what
// one-row decoding gives (both run this kernel). bf16 WMMA products, float accumulation, the
// output rounded once after the bias, as the CUDA-core kernel (linear.cuh).
//
// What fixes a row's reduction order, whatever M:
//   * one tile for every row count: rows in 16-row WMMA tiles (padded with zeros), up to 4 tiles
//     (64 rows) a pass, more rows in further passes over the same weights;
//   * K in chunks of 64, each as 4 mma_sync steps of 16 in k order, into float accumulators;
//   * the split of K over blocks (for parallelism when N is small) depends on N and K only
//     (tc_linear_splits): split s sums its chunks, then the splits' partial sums are added in
//     split order (linear_split_sum_kernel), then the bias. No atomics, no row-count-dependent
//     path: a tensor core's dot product for one output element reads only its row of x.
//
// Grid: (64-column tile of W, split). A block's 4 warps own 16 output columns each; per chunk
// the block stages W's 64 x 64 tile and x's rows x 64 in shared memory (16-byte loads where the
// rows allow it; the next chunk's loads are issued before the current chunk's products), and
// each warp loads its B fragment once for all of the pass's row tiles: W is read once per pass.
#pragma once

#include "cuda/device.h"
#include "cuda/wmma.h"

#if defined(JAKIRO_HAS_WMMA)

namespace jakiro::gpu {

struct TcLinearParams {
  const bf16* x;     // [M, K], contiguous
  const bf16* w;     // [N, K], contiguous
  const bf16* bias;  // [N] or null
  bf16* y;           // [M, N]
  float* partial;    // [splits, M, N] when splits > 1, else null
  int64_t M, K, N, splits;
};

constexpr int kTlWarps = 4;                           // warps a block: one 16-column tile each
constexpr int kTlCols = kTlWarps * kTcTile;           // output columns (weight rows) a block
constexpr int kTlRowTiles = 4;                        // 16-row tiles a pass: 64 rows
constexpr int kTlRows = kTlRowTiles * kTcTile;
constexpr int kTlChunk = 64;                          // K staged at a time: 4 mma steps
constexpr int kTlLd = kTlChunk + kTcPad;              // staged row stride (bf16)
constexpr int kTlRuns = kTlChunk / 8;                 // 16-byte runs of a staged row
constexpr int kTlThreads = kTlWarps * kWarp;
// Blocks resident a multiprocessor that the register budget must allow (at most 128 registers a
// thread; nvcc took 233 for sm_80 unbounded): more weight loads in flight at one row.
constexpr int kTlBlocksPerMultiprocessor = 3;
// Split count: aim at kTlTargetBlocks blocks (a few per multiprocessor of an H100/H200), with at
// least kTlMinSplitChunks chunks a split (a split's partial sums cost M x N floats written and
// read). Constants, not the device's: a row's bits are the same on every GPU. (The glue takes
// another target from JAKIRO_GPU_LINEAR_BLOCKS, for the kit's sweep: other bits, rows still
// independent of each other.)
constexpr int64_t kTlTargetBlocks = 512;
constexpr int64_t kTlMinSplitChunks = 8;
// Rows a launch takes when K is split (the partial sums' buffer is splits x this x N floats).
constexpr int64_t kTlLaunchRows = 256;

inline int64_t tc_linear_splits(int64_t N, int64_t K, int64_t target_blocks = kTlTargetBlocks) {
  const int64_t col_blocks = ceil_div(N, kTlCols), chunks = ceil_div(K, kTlChunk);
  const int64_t want = ceil_div(target_blocks, col_blocks > 0 ? col_blocks : 1);
  const int64_t most = chunks / kTlMinSplitChunks;
  return want < most ? want : (most > 1 ? most : 1);
}

struct TcLinearSmem {  // byte offsets into the dynamic shared memory
  static constexpr size_t w = 0;                                              // bf16 [kTlCols][kTlLd]
  static constexpr size_t x = w + sizeof(bf16) * kTlCols * kTlLd;             // bf16 [kTlRows][kTlLd]
  static constexpr size_t out = x + sizeof(bf16) * kTlRows * kTlLd;           // float [warps][16][16]
  static constexpr size_t total = out + sizeof(float) * kTlWarps * kTcTile * kTcTile;
};

// Elements [k, k + 8) of a row of K elements (those past K as 0), as 16 bytes: one load when
// `vec` (K a multiple of 8, rows 16-byte aligned), else element by element.
JAKIRO_DEVICE Pack16 load_run8(const bf16* row, int64_t k, int64_t K, bool vec) {
  Pack16 v{};
  if (vec) {
    if (k < K) v = load16(row + k);
  } else {
    bf16 e[8];
    for (int q = 0; q < 8; ++q) e[q] = k + q < K ? row[k + q] : bf16{0};
    memcpy(&v, e, sizeof v);
  }
  return v;
}

__global__ void __launch_bounds__(kTlThreads, kTlBlocksPerMultiprocessor) linear_wmma_kernel(TcLinearParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  return;  // bf16 WMMA needs sm_80; the glue never launches this kernel on older devices
#else
  constexpr int kSlots = kTlCols * kTlRuns / kTlThreads;  // 16-byte runs a thread stages per chunk
  static_assert(kSlots * kTlThreads == kTlCols * kTlRuns && kTlRows == kTlCols, "x and W tiles stage alike");
  const int64_t M = p.M, K = p.K, N = p.N, n0 = static_cast<int64_t>(blockIdx.x) * kTlCols;
  const int64_t split = blockIdx.y, chunks = ceil_div(K, kTlChunk);
  const int64_t c_begin = split * chunks / p.splits, c_end = (split + 1) * chunks / p.splits;
  const int warp = warp_id(), lane = lane_id();
  const bool vec = K % 8 == 0 && aligned16(p.x) && aligned16(p.w);

  JAKIRO_DYNAMIC_SMEM(unsigned char, smem);
  auto* w_s = reinterpret_cast<bf16*>(smem + TcLinearSmem::w);
  auto* x_s = reinterpret_cast<bf16*>(smem + TcLinearSmem::x);
  float* out_w = reinterpret_cast<float*>(smem + TcLinearSmem::out) + warp * kTcTile * kTcTile;

  for (int64_t row0 = 0; row0 < M; row0 += kTlRows) {
    const int64_t left = ceil_div(M - row0, kTcTile);
    const int tiles = static_cast<int>(left < kTlRowTiles ? left : kTlRowTiles);
    // Slot i of this thread: staged row (threadIdx.x + i * threads) / runs, run % runs.
    Pack16 w_next[kSlots], x_next[kSlots];
    auto fetch = [&](int64_t c) {
      const int64_t k0 = c * kTlChunk;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int s = static_cast<int>(threadIdx.x) + i * kTlThreads, r = s / kTlRuns;
        const int64_t k = k0 + (s % kTlRuns) * 8, n = n0 + r, m = row0 + r;
        w_next[i] = n < N ? load_run8(p.w + n * K, k, K, vec) : Pack16{};
        x_next[i] = Pack16{};
        if (r < tiles * kTcTile && m < M) x_next[i] = load_run8(p.x + m * K, k, K, vec);
      }
    };
    auto stage = [&]() {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        const int s = static_cast<int>(threadIdx.x) + i * kTlThreads, r = s / kTlRuns;
        const int at = r * kTlLd + (s % kTlRuns) * 8;
        *reinterpret_cast<Pack16*>(w_s + at) = w_next[i];
        if (r < tiles * kTcTile) *reinterpret_cast<Pack16*>(x_s + at) = x_next[i];
      }
    };

    TcFragC acc[kTlRowTiles];
#pragma unroll
    for (int t = 0; t < kTlRowTiles; ++t) wmma::fill_fragment(acc[t], 0.f);
    if (c_begin < c_end) {
      fetch(c_begin);
      stage();
      __syncthreads();
    }
    for (int64_t c = c_begin; c < c_end; ++c) {
      const bool more = c + 1 < c_end;
      if (more) fetch(c + 1);  // in flight while this chunk's products run
#pragma unroll
      for (int ks = 0; ks < kTlChunk / kTcTile; ++ks) {
        TcFragBCol b;
        wmma::load_matrix_sync(b, tc_ptr(w_s + warp * kTcTile * kTlLd + ks * kTcTile), kTlLd);
#pragma unroll
        for (int t = 0; t < kTlRowTiles; ++t) {
          if (t < tiles) {
            TcFragA a;
            wmma::load_matrix_sync(a, tc_ptr(x_s + t * kTcTile * kTlLd + ks * kTcTile), kTlLd);
            wmma::mma_sync(acc[t], a, b, acc[t]);
          }
        }
      }
      __syncthreads();
      if (more) {
        stage();
        __syncthreads();
      }
    }

    // Out: each tile through the warp's 16 x 16 floats (the fragment's lane layout stays hidden).
    const int64_t n_w = n0 + warp * kTcTile;
#pragma unroll
    for (int t = 0; t < kTlRowTiles; ++t) {
      if (t >= tiles) continue;
      wmma::store_matrix_sync(out_w, acc[t], kTcTile, wmma::mem_row_major);
      warp_sync();
      for (int e = lane; e < kTcTile * kTcTile; e += kWarp) {
        const int64_t m = row0 + t * kTcTile + e / kTcTile, n = n_w + e % kTcTile;
        if (m >= M || n >= N) continue;
        if (p.splits > 1) {
          p.partial[(split * M + m) * N + n] = out_w[e];
        } else {
          p.y[m * N + n] = from_float<bf16>(out_w[e] + (p.bias != nullptr ? to_float(p.bias[n]) : 0.f));
        }
      }
      warp_sync();
    }
  }
#endif
}

// y = the splits' partial sums added in split order, then the bias, rounded once.
__global__ void linear_split_sum_kernel(TcLinearParams p) {
  const int64_t total = p.M * p.N, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    float v = p.partial[i];
    for (int64_t s = 1; s < p.splits; ++s) v += p.partial[s * total + i];
    p.y[i] = from_float<bf16>(v + (p.bias != nullptr ? to_float(p.bias[i % p.N]) : 0.f));
  }
}

// p.splits is tc_linear_splits(N, K) (or another count: each gives rows independent of each
// other), and p.partial holds splits x M x N floats when it is over 1; needs bf16 WMMA (sm_80+).
inline void launch_linear_wmma(const TcLinearParams& p, cudaStream_t stream) {
  if (p.M == 0 || p.N == 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.N, kTlCols)), static_cast<unsigned>(p.splits));
  JAKIRO_LAUNCH(grid, kTlThreads, TcLinearSmem::total, stream, linear_wmma_kernel)(p);
  if (p.splits > 1) {
    constexpr int threads = 256;
    const int64_t blocks = ceil_div(p.M * p.N, threads);
    JAKIRO_LAUNCH(blocks < 4096 ? blocks : 4096, threads, 0, stream, linear_split_sum_kernel)(p);
  }
}

}  // namespace jakiro::gpu

#endif  // JAKIRO_HAS_WMMA
