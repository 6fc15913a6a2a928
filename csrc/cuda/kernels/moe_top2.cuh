// GPU kernels of jakiro::moe_top2, Jakiro's MoE feed-forward block: router (N routing + 2
// contrastive logits), top-2 of N SwiGLU experts, weighted combination plus the residual.
// Four launches, all float32 arithmetic whatever the element type:
//   1. router: one block per token, N + 2 logits, softmax, top-2, contrastive weights;
//   2. gate/up: per (expert, tile of the I intermediate columns), the skinny GEMM over just
//      the (token, slot) rows routed to the expert, SiLU(gate) * up fused into float32 h;
//   3. down: per (expert, tile of the H columns), the skinny GEMM of w_down over those rows
//      of h, into expert_out (element type, as the CPU kernel stores it);
//   4. combine: out = x + score_0 * expert_out_0 + score_1 * expert_out_1.
// Each expert's weights are read once for all its tokens (no per-token gather of weights).
#pragma once

#include "cuda/device.h"
#include "cuda/kernels/skinny_gemm.cuh"
#include "jakiro/router.h"

namespace jakiro::gpu {

struct MoeParams {
  const void* x;           // [M, H], scalar_t, contiguous
  const void* router;      // [N + 2, H]
  const void* w_gate;      // [N, I, H]
  const void* w_up;        // [N, I, H]
  const void* w_down;      // [N, H, I]
  void* out;               // [M, H], scalar_t
  void* expert_out;        // [M, 2, H], scalar_t
  int64_t* expert_idx;     // [M, 2]
  float* expert_score;     // [M, 2]
  float* contrast_weight;  // [M, 2]
  float* h;                // scratch [M * 2, I]: SiLU(gate) * up of each (token, slot)
  int64_t M, H, N, I;
  bool renormalize;
  int64_t tile_i, tile_h;  // weight rows per block of the gate/up and down kernels: set by the launcher
};

constexpr int kMoeThreads = 128;
constexpr int kMoeMaxExperts = 8;                           // check_moe_top2: 2 <= N <= 8
constexpr int kMoeEntriesPerThread = 4;                     // expert_idx entries each thread scans
constexpr int kMoeChunk = kMoeThreads * kMoeEntriesPerThread;  // (token, slot) entries per scan

// 1. Router: one block per token, its threads splitting H in 16-byte runs (thread t takes runs
// t, t + blockDim.x, ...; vector loads when H is a multiple of the run and the rows are
// aligned, else scalar loads in the same order), the N + 2 dot products reduced per warp, then
// across warps in a fixed order. A block rather than a warp per token: at decoding sizes the
// router is latency-bound, and one warp streaming (N + 2) rows of H alone is the slowest launch.
template <typename scalar_t>
__global__ void moe_router_kernel(MoeParams p) {
  __shared__ float partial[kMoeThreads / kWarp][kMoeMaxExperts + 2];
  const int64_t m = blockIdx.x;
  const int64_t H = p.H, N = p.N, L = p.N + 2;
  constexpr int V = kSkinnyRun<scalar_t>;
  const scalar_t* x = static_cast<const scalar_t*>(p.x) + m * H;
  const scalar_t* w = static_cast<const scalar_t*>(p.router);
  bool vec = H % V == 0 && aligned16(x) && aligned16(w);
  float logit[kMoeMaxExperts + 2];
  for (int e = 0; e < kMoeMaxExperts + 2; ++e) logit[e] = 0.f;
  const int64_t runs = (H + V - 1) / V;
  for (int64_t c = threadIdx.x; c < runs; c += blockDim.x) {
    float xv[V];
    if (vec) {
      skinny_detail::load_run_aligned(x + c * V, xv);
    } else {
      skinny_detail::load_run_scalar(x + c * V, H - c * V, xv);
    }
    JAKIRO_UNROLL
    for (int e = 0; e < kMoeMaxExperts + 2; ++e) {
      if (e < L) {
        float wv[V];
        if (vec) {
          skinny_detail::load_run_aligned(w + e * H + c * V, wv);
        } else {
          skinny_detail::load_run_scalar(w + e * H + c * V, H - c * V, wv);
        }
        JAKIRO_UNROLL
        for (int i = 0; i < V; ++i) logit[e] += xv[i] * wv[i];
      }
    }
  }
  for (int e = 0; e < kMoeMaxExperts + 2; ++e) {
    logit[e] = warp_sum(logit[e]);
    if (lane_id() == 0) partial[warp_id()][e] = logit[e];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int e = 0; e < L; ++e) {
      float sum = partial[0][e];
      for (int wi = 1; wi < num_warps(); ++wi) sum += partial[wi][e];
      logit[e] = sum;
    }
    const Top2Route route = route_top2(logit, N, p.renormalize);
    for (int s = 0; s < 2; ++s) {
      p.expert_idx[m * 2 + s] = route.expert[s];
      p.expert_score[m * 2 + s] = route.score[s];
      p.contrast_weight[m * 2 + s] = route.contrast_weight[s];
    }
  }
}

// The (token * 2 + slot) entries in [c0, c0 + kMoeChunk) of expert_idx [total] routed to
// expert e, in ascending order, into rows; returns how many (the same on every thread).
// A block-wide prefix sum of per-thread counts (warp scans by shuffle, then across warps).
// Every thread of the block must call it; it ends with a barrier, and its first barrier
// orders the writes to `rows` after every thread's use of the previous chunk.
JAKIRO_DEVICE int collect_expert_rows(const int64_t* expert_idx, int64_t total, int64_t c0, int64_t e,
                                      int64_t* rows, int* warp_counts) {
  const int64_t first = c0 + static_cast<int64_t>(threadIdx.x) * kMoeEntriesPerThread;
  int count = 0;
  for (int i = 0; i < kMoeEntriesPerThread; ++i)
    if (first + i < total && expert_idx[first + i] == e) ++count;
  const int lane = lane_id();
  int incl = count;  // inclusive scan over the warp's lanes
  for (int o = 1; o < kWarp; o *= 2) {
    const int t = warp_shfl(incl, lane >= o ? lane - o : lane);
    if (lane >= o) incl += t;
  }
  if (lane == kWarp - 1) warp_counts[warp_id()] = incl;
  __syncthreads();
  int base = incl - count, n = 0;
  for (int w = 0; w < num_warps(); ++w) {
    if (w < warp_id()) base += warp_counts[w];
    n += warp_counts[w];
  }
  for (int i = 0; i < kMoeEntriesPerThread; ++i)
    if (first + i < total && expert_idx[first + i] == e) rows[base++] = first + i;
  __syncthreads();
  return n;
}

// 2. Gate/up: block (tile of I, expert e); h[row, i] = SiLU(x_t . w_gate[e, i]) * (x_t . w_up[e, i]).
template <typename scalar_t>
__global__ void moe_gate_up_kernel(MoeParams p) {
  __shared__ int64_t rows[kMoeChunk];
  __shared__ int warp_counts[kMoeThreads / kWarp];
  const int64_t e = blockIdx.y, H = p.H, I = p.I, total = p.M * 2;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * p.tile_i;
  const int64_t j1 = j0 + p.tile_i < I ? j0 + p.tile_i : I;
  const WeightSet<scalar_t, 2> W{
      {static_cast<const scalar_t*>(p.w_gate) + e * I * H, static_cast<const scalar_t*>(p.w_up) + e * I * H}, H};
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  float* h = p.h;
  for (int64_t c0 = 0; c0 < total; c0 += kMoeChunk) {
    const int n = collect_expert_rows(p.expert_idx, total, c0, e, rows, warp_counts);
    skinny_gemm_tile(
        W, H, j0, j1, n, [&](int64_t r) { return x + (rows[r] / 2) * H; },
        [&](int64_t r, int64_t j, const float* v) { h[rows[r] * I + j] = silu(v[0]) * v[1]; });
  }
}

// 3. Down: block (tile of H, expert e); expert_out[row, d] = h[row, :] . w_down[e, d, :].
template <typename scalar_t>
__global__ void moe_down_kernel(MoeParams p) {
  __shared__ int64_t rows[kMoeChunk];
  __shared__ int warp_counts[kMoeThreads / kWarp];
  const int64_t e = blockIdx.y, H = p.H, I = p.I, total = p.M * 2;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * p.tile_h;
  const int64_t j1 = j0 + p.tile_h < H ? j0 + p.tile_h : H;
  const WeightSet<scalar_t, 1> W{{static_cast<const scalar_t*>(p.w_down) + e * H * I}, I};
  const float* h = p.h;
  scalar_t* expert_out = static_cast<scalar_t*>(p.expert_out);
  for (int64_t c0 = 0; c0 < total; c0 += kMoeChunk) {
    const int n = collect_expert_rows(p.expert_idx, total, c0, e, rows, warp_counts);
    skinny_gemm_tile(
        W, I, j0, j1, n, [&](int64_t r) { return h + rows[r] * I; },
        [&](int64_t r, int64_t j, const float* v) { expert_out[rows[r] * H + j] = from_float<scalar_t>(v[0]); });
  }
}

// 4. Combine, element-wise over [M, H] (grid-stride): x + score_0 * h_0, then + score_1 * h_1,
// reading expert_out as stored (in the element type), as the CPU kernel does.
template <typename scalar_t>
__global__ void moe_combine_kernel(MoeParams p) {
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const scalar_t* eo = static_cast<const scalar_t*>(p.expert_out);
  scalar_t* out = static_cast<scalar_t*>(p.out);
  const int64_t H = p.H, total = p.M * p.H;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t m = i / H, d = i - m * H;
    if (p.expert_idx[m * 2] < 0) {  // no routing (non-finite router logits): NaN outputs
      const scalar_t nan = from_float<scalar_t>(quiet_nan());
      static_cast<scalar_t*>(p.expert_out)[(m * 2) * H + d] = nan;
      static_cast<scalar_t*>(p.expert_out)[(m * 2 + 1) * H + d] = nan;
      out[i] = nan;
      continue;
    }
    float acc = to_float(x[i]);
    acc += p.expert_score[m * 2] * to_float(eo[(m * 2) * H + d]);
    acc += p.expert_score[m * 2 + 1] * to_float(eo[(m * 2 + 1) * H + d]);
    out[i] = from_float<scalar_t>(acc);
  }
}

template <typename scalar_t>
void launch_moe_top2(const MoeParams& params, cudaStream_t stream) {
  if (params.M == 0) return;
  MoeParams p = params;
  constexpr int warps = kMoeThreads / kWarp;
  p.tile_i = skinny_tile_rows(p.I, warps);
  p.tile_h = skinny_tile_rows(p.H, warps);
  JAKIRO_LAUNCH(p.M, kMoeThreads, 0, stream, moe_router_kernel<scalar_t>)(p);
  const unsigned experts = static_cast<unsigned>(p.N);
  if (p.I > 0) {
    const dim3 grid(static_cast<unsigned>((p.I + p.tile_i - 1) / p.tile_i), experts);
    JAKIRO_LAUNCH(grid, kMoeThreads, 0, stream, moe_gate_up_kernel<scalar_t>)(p);
  }
  const dim3 grid(static_cast<unsigned>((p.H + p.tile_h - 1) / p.tile_h), experts);
  JAKIRO_LAUNCH(grid, kMoeThreads, 0, stream, moe_down_kernel<scalar_t>)(p);
  constexpr int64_t kCombineThreads = 256, kCombineMaxBlocks = 4096;
  const int64_t blocks = (p.M * p.H + kCombineThreads - 1) / kCombineThreads;
  JAKIRO_LAUNCH(blocks < kCombineMaxBlocks ? blocks : kCombineMaxBlocks, kCombineThreads, 0, stream,
                moe_combine_kernel<scalar_t>)(p);
}

}  // namespace jakiro::gpu
