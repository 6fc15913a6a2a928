// Block-wide exact top-k selection, shared by the GPU kernels of contrastive_topk (top-k of the
// logits) and verify_tree (top-k threshold and top-p set of the sampling filters).
//
// Order: jakiro::ranks_before (larger value first; ties: lower index first), so the results
// equal the CPU kernels' TopK lists. Selection runs in rounds of up to KMAX winners:
//   1. each thread keeps a local TopK (capacity KMAX) of its candidates that rank after the
//      last winner of the previous round (and, to keep the local lists short, not after a
//      bound that at least KMAX candidates reach: the worst of a warp's lane maxima);
//   2. each warp extracts its best KMAX, in rank order, by repeated warp argmax over its
//      lanes' list heads (into shared memory);
//   3. warp 0 merges the warps' lists the same way into the round's KMAX winners.
// A list that was full can never run dry within a round (a round takes at most KMAX winners),
// so each round is exact; k <= KMAX takes one round, larger k takes ceil(k / KMAX).
// Values must not be NaN (ranks_before is then no order).
#pragma once

#include "cuda/device.h"
#include "jakiro/topk.h"

namespace jakiro::gpu {

// A thread's sorted candidate list in local arrays (jakiro::BasicTopK over them).
template <typename V, int KMAX>
struct ThreadTopK {
  V values[KMAX];
  int64_t indices[KMAX];
  BasicTopK<V> list{values, indices, KMAX};  // points into this object: never copied

  JAKIRO_DEVICE void push(V v, int64_t i) { list.push(v, i); }
  JAKIRO_DEVICE int size() const { return static_cast<int>(list.count); }
};

// Shared memory of the selection (declare it `__shared__` in the kernel).
template <typename V, int KMAX, int THREADS>
struct BlockTopKShared {
  static_assert(THREADS % kWarp == 0 && THREADS / kWarp <= kWarp, "THREADS: whole warps, at most kWarp of them");
  static constexpr int kWarps = THREADS / kWarp;
  V warp_values[kWarps][KMAX];  // each warp's best, in rank order; index -1 ends a list
  int64_t warp_indices[kWarps][KMAX];
  V values[KMAX];  // the round's winners, in rank order; index -1 after the last
  int64_t indices[KMAX];
  V bound_values[kWarps];  // per warp: the worst of its lanes' best candidates
  int64_t bound_indices[kWarps];
};

// Best (value, index) over the warp's lanes (index -1: nothing); every lane gets it (a strict
// total order makes the butterfly agree in all lanes).
template <typename V>
JAKIRO_DEVICE void warp_best(V& v, int64_t& i) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const V other_v = warp_shfl_xor(v, o);
    const int64_t other_i = warp_shfl_xor(i, o);
    if (other_i >= 0 && (i < 0 || ranks_before(other_v, other_i, v, i))) {
      v = other_v;
      i = other_i;
    }
  }
}

// Visits i = threadIdx.x + j * THREADS < n in increasing order: use(i, load(i)). The loads of
// UNROLL consecutive visits are issued before their uses, so that a block alone on a long row
// keeps several loads in flight per thread.
template <int THREADS, int UNROLL = 4, typename Load, typename Use>
JAKIRO_DEVICE void strided_for(int64_t n, Load load, Use use) {
  using T = decltype(load(int64_t{0}));
  for (int64_t base = threadIdx.x; base < n; base += static_cast<int64_t>(THREADS) * UNROLL) {
    T v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * THREADS;
      if (i < n) v[u] = load(i);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * THREADS;
      if (i < n) use(i, v[u]);
    }
  }
}

// Worst (value, index) over the warp's lanes; index -1 (nothing) if any lane has nothing.
template <typename V>
JAKIRO_DEVICE void warp_worst(V& v, int64_t& i) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const V other_v = warp_shfl_xor(v, o);
    const int64_t other_i = warp_shfl_xor(i, o);
    if (i >= 0 && (other_i < 0 || ranks_before(v, i, other_v, other_i))) {
      v = other_v;
      i = other_i;
    }
  }
}

// Best (value, index) over the block, every thread gets it; index -1 when no thread has one.
// `sv`, `si`: shared memory of num_warps() elements each. Ends with a barrier.
template <typename V>
JAKIRO_DEVICE void block_best(V& v, int64_t& i, V* sv, int64_t* si) {
  warp_best(v, i);
  if (lane_id() == 0) {
    sv[warp_id()] = v;
    si[warp_id()] = i;
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
  for (int w = 1; w < num_warps(); ++w) {
    if (si[w] >= 0 && (i < 0 || ranks_before(sv[w], si[w], v, i))) {
      v = sv[w];
      i = si[w];
    }
  }
  __syncthreads();
}

// Moves the best entries of the lanes' sorted lists, up to KMAX in rank order, to out_v/out_i
// (written by lane 0, -1 index after the last). `head(pos, v, i)` gives the lane's entry at
// `pos` (index -1 past its end). Whole warp.
template <int KMAX, typename V, typename Head>
JAKIRO_DEVICE void warp_extract(Head head, V* out_v, int64_t* out_i) {
  int pos = 0;
  for (int step = 0; step < KMAX; ++step) {
    V v;
    int64_t i;
    head(pos, v, i);
    const int64_t mine = i;
    warp_best(v, i);
    if (lane_id() == 0) {
      out_v[step] = v;
      out_i[step] = i;
    }
    if (i < 0) break;  // warp-uniform: no lane has entries left
    if (mine == i) ++pos;
  }
}

// One round: the (up to) KMAX best candidates among indices [0, n) that rank after
// (last_v, last_i) (all candidates when !after_last), into s.values/s.indices in rank order.
// `candidate(i, v)` says whether index i is a candidate and gives its value; each thread asks
// for i = threadIdx.x + j * THREADS. Returns the number of winners (the same in every thread).
template <int KMAX, int THREADS, typename V, typename Candidate>
JAKIRO_DEVICE int block_topk_round(int64_t n, Candidate& candidate, bool after_last, V last_v, int64_t last_i,
                                   BlockTopKShared<V, KMAX, THREADS>& s) {
  static_assert(KMAX <= kWarp, "the pruning bound needs KMAX <= the warp width");
  const int warp = warp_id();
  // The bound: every lane of a warp has a candidate ranking at or before the worst of their
  // best ones, so kWarp >= KMAX candidates do and the round's winners all rank at or before
  // the best such bound. Candidates ranking after it are not pushed (most of them, for k << n).
  V bound_v = V(0);
  int64_t bound_i = -1;
  struct Cand {
    V v;
    bool ok;
  };
  auto load = [&](int64_t i) {
    Cand c;
    c.ok = candidate(i, c.v) && (!after_last || ranks_before(last_v, last_i, c.v, i));
    return c;
  };
  strided_for<THREADS>(n, load, [&](int64_t i, const Cand& c) {
    if (c.ok && (bound_i < 0 || ranks_before(c.v, i, bound_v, bound_i))) {
      bound_v = c.v;
      bound_i = i;
    }
  });
  warp_worst(bound_v, bound_i);
  if (lane_id() == 0) {
    s.bound_values[warp] = bound_v;
    s.bound_indices[warp] = bound_i;
  }
  __syncthreads();
  for (int w = 0; w < BlockTopKShared<V, KMAX, THREADS>::kWarps; ++w) {
    const int64_t wi = s.bound_indices[w];
    if (wi >= 0 && (bound_i < 0 || ranks_before(s.bound_values[w], wi, bound_v, bound_i))) {
      bound_v = s.bound_values[w];
      bound_i = wi;
    }
  }
  ThreadTopK<V, KMAX> list;
  strided_for<THREADS>(n, load, [&](int64_t i, const Cand& c) {
    if (c.ok && (bound_i < 0 || !ranks_before(bound_v, bound_i, c.v, i))) list.push(c.v, i);
  });
  warp_extract<KMAX>(
      [&](int pos, V& v, int64_t& i) {
        const bool has = pos < list.size();
        v = has ? list.values[pos] : V(0);
        i = has ? list.indices[pos] : -1;
      },
      s.warp_values[warp], s.warp_indices[warp]);
  __syncthreads();
  if (warp == 0) {
    const int lane = lane_id();
    warp_extract<KMAX>(
        [&](int pos, V& v, int64_t& i) {
          const bool has = lane < BlockTopKShared<V, KMAX, THREADS>::kWarps && pos < KMAX;
          v = has ? s.warp_values[lane][pos] : V(0);
          i = has ? s.warp_indices[lane][pos] : -1;
        },
        s.values, s.indices);
  }
  __syncthreads();
  int count = 0;
  while (count < KMAX && s.indices[count] >= 0) ++count;
  return count;
}

// Visits the k best candidates (fewer if there are fewer) in rank order: visit(rank, v, i) runs
// in every thread with the same arguments and returns whether to go on; its answer must be the
// same in every thread (a function of the visited sequence), since rounds hold barriers.
// Must be called by every thread of a block of THREADS threads.
template <int KMAX, int THREADS, typename V, typename Candidate, typename Visit>
JAKIRO_DEVICE void block_topk(int64_t n, int64_t k, Candidate candidate, BlockTopKShared<V, KMAX, THREADS>& s,
                              Visit visit) {
  int64_t taken = 0;
  V last_v = V(0);
  int64_t last_i = -1;
  while (taken < k) {
    const int count = block_topk_round<KMAX, THREADS>(n, candidate, taken > 0, last_v, last_i, s);
    // The winners are read here, before this thread reaches the next round's first barrier;
    // they are only rewritten after it.
    bool stop = count < KMAX;
    for (int j = 0; j < count && taken < k; ++j) {
      last_v = s.values[j];
      last_i = s.indices[j];
      if (!visit(taken, last_v, last_i)) {
        stop = true;
        break;
      }
      ++taken;
    }
    if (stop) break;
  }
}

}  // namespace jakiro::gpu
