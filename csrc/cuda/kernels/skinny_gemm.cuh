// The weight-stationary "skinny GEMM" of the GPU kernels, framework-free: Y[r, j] = X[r, :] . W[j, :]
// for a few input rows X (decode / tree-verification sizes) and a large weight W [N, K] (float32
// or bf16), the product that jakiro::linear and the experts of jakiro::moe_top2 are made of.
// At these sizes the product is bound by reading W, so W is streamed from memory once: a block
// owns a tile of weight rows (output columns), each warp R weight rows at a time, its lanes
// splitting K in 16-byte runs (coalesced, vectorized reads when the rows are 16-byte aligned);
// the rows are used for every input row in passes of up to kSkinnyRows rows (per-lane float32
// accumulators), later passes finding them in L1/L2, then warp-reduced (a transposed butterfly).
// Every output element is summed in the same order whatever the number of input rows, the pass
// it falls in and the alignment of its row (the scalar fallback follows the vector order), so
// a token's result does not depend on the rows beside it.
#pragma once

#include <cstring>

#include "cuda/device.h"

namespace jakiro::gpu {

constexpr int kSkinnyRows = 8;      // input rows per pass (accumulators per lane and weight matrix)
constexpr int kSkinnyUnroll = 2;    // 16-byte loads per lane and weight row in flight in the K loop
constexpr int64_t kSkinnyMaxBlocks = 1024;  // beyond this many tiles, tiles grow instead

// Elements of a weight row in one 16-byte load: the run of K that a lane takes at a time.
template <typename w_t>
constexpr int kSkinnyRun = static_cast<int>(16 / sizeof(w_t));

// NW weight matrices of the same shape [N, K] (row stride ld) read at the same weight row:
// NW = 2 computes gate and up projections together for the fused SwiGLU.
template <typename w_t, int NW>
struct WeightSet {
  const w_t* w[NW];
  int64_t ld;
};

// Weight rows per block tile for N weight rows and `warps` warps per block: one row per warp,
// more once there would be over kSkinnyMaxBlocks tiles (fewer, longer-lived blocks).
inline int64_t skinny_tile_rows(int64_t N, int64_t warps) {
  const int64_t per_warp = (((N + warps - 1) / warps) + kSkinnyMaxBlocks - 1) / kSkinnyMaxBlocks;
  return warps * (per_warp > 0 ? per_warp : 1);
}

namespace skinny_detail {

// Sums each of a[0, NP) over the lanes of the warp with NP/2 + NP/4 + ... + 1 + log2(kWarp / NP)
// shuffles instead of NP * log2(kWarp): in the first log2(NP) butterfly steps a lane keeps one
// half of its values and trades the other half with its partner. Returns, on lane l, the sum
// of value l / (kWarp / NP). The pairings (xor kWarp/2, ..., 1) and hence the rounding are those
// of warp_sum for every value and every NP (float addition is commutative).
template <int NP>
JAKIRO_DEVICE float reduce_transposed(float (&a)[kSkinnyRows]) {
  const int lane = lane_id();
  int o = kWarp / 2;
  JAKIRO_UNROLL
  for (int c = NP / 2; c >= 1; c /= 2, o /= 2) {
    const bool upper = (lane & o) != 0;
    JAKIRO_UNROLL
    for (int i = 0; i < c; ++i) {
      const float send = upper ? a[i] : a[i + c];
      const float keep = upper ? a[i + c] : a[i];
      a[i] = keep + warp_shfl_xor(send, o);
    }
  }
  float v = a[0];
  for (; o > 0; o /= 2) v += warp_shfl_xor(v, o);
  return v;
}

// Elements [0, V) of a 16-byte-aligned row as floats, in 16-byte loads.
template <int V, typename T>
JAKIRO_DEVICE void load_run_aligned(const T* p, float (&out)[V]) {
  constexpr int per_load = static_cast<int>(16 / sizeof(T));
  static_assert(V % per_load == 0, "a run is whole 16-byte loads");
  JAKIRO_UNROLL
  for (int i = 0; i < V / per_load; ++i) unpack_to(load16(p + i * per_load), out, i * per_load, p);
}
// The same elements one at a time, those at or past `limit` read as 0 (any alignment).
template <int V, typename T>
JAKIRO_DEVICE void load_run_scalar(const T* p, int64_t limit, float (&out)[V]) {
  JAKIRO_UNROLL
  for (int e = 0; e < V; ++e) out[e] = e < limit ? to_float(p[e]) : 0.f;
}

// One pass: input rows [r0, r0 + NP) against the NR = R * NW weight rows wr (R output
// columns js[i], each with its NW matrices at wr[i * NW + q]), all of the warp's lanes
// splitting K; lane p * (kWarp / NP) hands row r0 + p's results to the epilogue.
// K is cut into runs of V = kSkinnyRun<w_t> elements, lane l taking runs l, l + kWarp, ...,
// and every accumulator adds its products run after run, element after element: with 16-byte
// loads when K is a multiple of V and every row is 16-byte aligned (warp-uniform), else with
// scalar loads in the same order (bit-identical results).
template <int NP, int NW, int R, typename w_t, typename RowPtr, typename Epilogue>
JAKIRO_DEVICE void pass(const w_t* (&wr)[R * NW], const int64_t (&js)[R], int64_t K, int64_t r0, RowPtr& row_ptr,
                        Epilogue& epilogue) {
  static_assert(NP <= kSkinnyRows && NP <= kWarp, "a pass has at most kSkinnyRows rows");
  constexpr int V = kSkinnyRun<w_t>;
  constexpr int NR = R * NW;
  using x_ptr = decltype(row_ptr(r0));
  x_ptr xr[NP];
  bool vec = K % V == 0;
  JAKIRO_UNROLL
  for (int p = 0; p < NP; ++p) {
    xr[p] = row_ptr(r0 + p);
    vec = vec && aligned16(xr[p]);
  }
  JAKIRO_UNROLL
  for (int q = 0; q < NR; ++q) vec = vec && aligned16(wr[q]);
  float acc[NR][kSkinnyRows];
  JAKIRO_UNROLL
  for (int q = 0; q < NR; ++q)
    JAKIRO_UNROLL
    for (int p = 0; p < NP; ++p) acc[q][p] = 0.f;
  const int64_t runs = (K + V - 1) / V;
  int64_t c = lane_id();
  if (vec) {
    // kSkinnyUnroll runs per weight row loaded before the FMAs, for memory-level parallelism.
    for (; c + (kSkinnyUnroll - 1) * kWarp < runs; c += kSkinnyUnroll * kWarp) {
      float w[NR][kSkinnyUnroll][V];
      JAKIRO_UNROLL
      for (int q = 0; q < NR; ++q)
        JAKIRO_UNROLL
        for (int u = 0; u < kSkinnyUnroll; ++u) load_run_aligned(wr[q] + (c + u * kWarp) * V, w[q][u]);
      JAKIRO_UNROLL
      for (int u = 0; u < kSkinnyUnroll; ++u) {
        JAKIRO_UNROLL
        for (int p = 0; p < NP; ++p) {
          float xv[V];
          load_run_aligned(xr[p] + (c + u * kWarp) * V, xv);
          JAKIRO_UNROLL
          for (int e = 0; e < V; ++e)
            JAKIRO_UNROLL
            for (int q = 0; q < NR; ++q) acc[q][p] += w[q][u][e] * xv[e];
        }
      }
    }
    for (; c < runs; c += kWarp) {
      float w[NR][V];
      JAKIRO_UNROLL
      for (int q = 0; q < NR; ++q) load_run_aligned(wr[q] + c * V, w[q]);
      JAKIRO_UNROLL
      for (int p = 0; p < NP; ++p) {
        float xv[V];
        load_run_aligned(xr[p] + c * V, xv);
        JAKIRO_UNROLL
        for (int e = 0; e < V; ++e)
          JAKIRO_UNROLL
          for (int q = 0; q < NR; ++q) acc[q][p] += w[q][e] * xv[e];
      }
    }
  } else {
    for (; c < runs; c += kWarp) {
      const int64_t limit = K - c * V;
      float w[NR][V];
      JAKIRO_UNROLL
      for (int q = 0; q < NR; ++q) load_run_scalar(wr[q] + c * V, limit, w[q]);
      JAKIRO_UNROLL
      for (int p = 0; p < NP; ++p) {
        float xv[V];
        load_run_scalar(xr[p] + c * V, limit, xv);
        JAKIRO_UNROLL
        for (int e = 0; e < V; ++e)
          JAKIRO_UNROLL
          for (int q = 0; q < NR; ++q) acc[q][p] += w[q][e] * xv[e];
      }
    }
  }
  float sums[NR];
  JAKIRO_UNROLL
  for (int q = 0; q < NR; ++q) sums[q] = reduce_transposed<NP>(acc[q]);
  constexpr int spread = kWarp / NP;
  const int lane = lane_id();
  if (lane % spread == 0) {
    JAKIRO_UNROLL
    for (int i = 0; i < R; ++i) {
      float v[NW];
      JAKIRO_UNROLL
      for (int q = 0; q < NW; ++q) v[q] = sums[i * NW + q];
      epilogue(r0 + lane / spread, js[i], static_cast<const float*>(v));
    }
  }
}

// R output columns js (weight rows) against every input row, in passes of 8, 4, 2, 1 rows
// (no wasted arithmetic on a partial pass).
template <int R, int NW, typename w_t, typename RowPtr, typename Epilogue>
JAKIRO_DEVICE void columns(const WeightSet<w_t, NW>& W, const int64_t (&js)[R], int64_t K, int64_t rows,
                           RowPtr& row_ptr, Epilogue& epilogue) {
  const w_t* wr[R * NW];
  JAKIRO_UNROLL
  for (int i = 0; i < R; ++i)
    JAKIRO_UNROLL
    for (int q = 0; q < NW; ++q) wr[i * NW + q] = W.w[q] + js[i] * W.ld;
  int64_t r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) pass<8, NW, R>(wr, js, K, r0, row_ptr, epilogue);
  if (rows - r0 >= 4) {
    pass<4, NW, R>(wr, js, K, r0, row_ptr, epilogue);
    r0 += 4;
  }
  if (rows - r0 >= 2) {
    pass<2, NW, R>(wr, js, K, r0, row_ptr, epilogue);
    r0 += 2;
  }
  if (rows - r0 >= 1) pass<1, NW, R>(wr, js, K, r0, row_ptr, epilogue);
}

}  // namespace skinny_detail

// The block's tile of weight rows [j0, j1) against input rows [0, rows): for each (r, j),
// one lane of one warp calls epilogue(r, j, const float* v) with v[q] = X[r, :] . W_q[j, :].
// row_ptr(r) gives input row r (K elements of float or bf16; any gather goes there). Warp w
// takes weight rows j0 + w, j0 + w + num_warps(), ..., R of them at a time (more loads in
// flight and R independent reductions to overlap, for short rows); each weight row is read from
// memory once per call. No barriers; every lane of each warp must call it.
template <int R = 1, int NW, typename w_t, typename RowPtr, typename Epilogue>
JAKIRO_DEVICE void skinny_gemm_tile(const WeightSet<w_t, NW>& W, int64_t K, int64_t j0, int64_t j1, int64_t rows,
                                    RowPtr row_ptr, Epilogue epilogue) {
  using namespace skinny_detail;
  const int64_t step = num_warps();
  int64_t j = j0 + warp_id();
  for (; j + (R - 1) * step < j1; j += R * step) {
    int64_t js[R];
    for (int i = 0; i < R; ++i) js[i] = j + i * step;
    columns<R>(W, js, K, rows, row_ptr, epilogue);
  }
  for (; j < j1; j += step) {
    const int64_t js[1] = {j};
    columns<1>(W, js, K, rows, row_ptr, epilogue);
  }
}

static_assert(kSkinnyRows == 8, "skinny_gemm_tile splits passes into 8, 4, 2, 1 rows");

}  // namespace jakiro::gpu
