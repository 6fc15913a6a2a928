// GPU kernels of tree verification (the CPU kernel: cpu/verify_tree.cpp; the sampling rules both
// follow: jakiro/sampling.h).
//
// Greedy (temperature 0): the target's argmax at every (sequence, node) in parallel, a block
// each (ties: lowest index; -1 for a row with a NaN or +inf logit or only -inf, like the CPU's
// argmax_at); then jakiro::greedy_walk, one thread per sequence.
// Sampling: one block per sequence walks its tree by the rules of jakiro/sampling.h. At each
// visited node the block builds the filtered distribution in a float64 scratch row w[V] exactly
// like the CPU's filtered_distribution (top-k threshold and the top-p set by the block selection
// of kernels/block_topk.cuh; the top-p mass is summed in rank order like the CPU), thread 0 tests
// the children (test_children), and on rejection the block draws the bonus token by inverse CDF
// in token order (block prefix sums over contiguous per-thread chunks). Every decision is taken
// from shared memory, so control flow stays block-uniform.
#pragma once

#include "cuda/device.h"
#include "cuda/kernels/block_topk.cuh"
#include "jakiro/sampling.h"
#include "jakiro/tree.h"

namespace jakiro::gpu {

struct VerifyParams {
  const int64_t* parents;  // [B, T]
  const int64_t* tokens;   // [B, T]
  const void* logits;      // [B, T, V], scalar_t
  const double* uniforms;  // [B, T + 1] (sampling only)
  int64_t* path;           // [B, T], filled with -1 by the caller
  int64_t* accept_len;     // [B]
  int64_t* bonus;          // [B]
  int64_t* choice;         // scratch [B, T]: greedy argmax per node
  double* weights;         // scratch [B, V]: sampling distribution of the current node
  int64_t batch, nodes, vocab;
  double temperature, top_p;
  int64_t top_k;
  int32_t* errors;         // the device's error word
};

// Reports what the CPU op rejects on the host in sequence b's tree: parents not a tree in
// topological order, draft token ids outside the vocabulary, uniforms outside [0, 1). The
// walks stay inside the tree whatever the values (children are searched among nodes 0..T-1, a
// bad token weighs 0), so checking is all that is left to do. One thread.
JAKIRO_DEVICE void report_bad_tree(const VerifyParams& p, int64_t b) {
  const int64_t T = p.nodes;
  const int64_t* parents = p.parents + b * T;
  const int64_t* tokens = p.tokens + b * T;
  if (parents[0] != -1) report_error(p.errors, kBadParents);
  for (int64_t i = 1; i < T; ++i) {
    if (parents[i] < 0 || parents[i] >= i) report_error(p.errors, kBadParents);
    if (tokens[i] < 0 || tokens[i] >= p.vocab) report_error(p.errors, kBadTokens);
  }
  if (p.temperature > 0.0) {
    for (int64_t i = 0; i <= T; ++i) {
      const double u = p.uniforms[b * (T + 1) + i];
      if (!(u >= 0.0 && u < 1.0)) report_error(p.errors, kBadUniforms);
    }
  }
}

namespace verify {
constexpr int kThreads = 256;       // sampling blocks
constexpr int kWideThreads = 1024;  // sampling blocks for vocabularies of kWideVocab and more
constexpr int64_t kWideVocab = 8192;
constexpr int kMaxThreads = 256;  // argmax blocks (fewer for small vocabularies)
constexpr int kWalkThreads = 128;
constexpr int kThresholdK = 32;  // selection round size of the top-k threshold (float logits)
constexpr int kThresholdRounds = 8;  // top_k beyond kThresholdRounds rounds: bisection instead
constexpr int kTopP = 32;        // selection round size of the top-p set (float64 probabilities)
}  // namespace verify

JAKIRO_DEVICE double neg_inf_d() { return static_cast<double>(neg_inf()); }

JAKIRO_DEVICE float float_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
// Keys of floats that order like the floats (NaN aside; -0 just before +0), and back.
JAKIRO_DEVICE uint32_t order_key(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
JAKIRO_DEVICE float from_order_key(uint32_t key) {
  return float_from_bits((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

template <typename scalar_t>
__global__ void verify_argmax_kernel(VerifyParams p) {
  __shared__ float sv[verify::kMaxThreads / kWarp];
  __shared__ int64_t si[verify::kMaxThreads / kWarp];
  __shared__ float red[verify::kMaxThreads / kWarp];
  const scalar_t* row = static_cast<const scalar_t*>(p.logits) + static_cast<int64_t>(blockIdx.x) * p.vocab;
  float best_v = 0.f, bad = 0.f;
  int64_t best_i = -1;
  for (int64_t i = threadIdx.x; i < p.vocab; i += blockDim.x) {
    const float v = to_float(row[i]);
    if (poisons(v)) bad = 1.f;
    if (best_i < 0 || v > best_v) {
      best_v = v;
      best_i = i;
    }
  }
  const bool poisoned = block_max(bad, red) > 0.f;
  block_best(best_v, best_i, sv, si);
  if (threadIdx.x == 0) {
    // -1: no distribution (a NaN or +inf logit, or every logit -inf); greedy_walk abandons.
    p.choice[blockIdx.x] = (poisoned || best_i < 0 || best_v == neg_inf()) ? -1 : best_i;
  }
}

template <typename scalar_t>
__global__ void verify_greedy_walk_kernel(VerifyParams p) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;  // no barriers in this kernel
  report_bad_tree(p, b);
  const int64_t T = p.nodes;
  const int64_t* choice = p.choice + b * T;
  const int64_t length = greedy_walk(
      p.parents + b * T, p.tokens + b * T, T, [&](int64_t node) { return choice[node]; }, p.path + b * T,
      p.bonus + b);
  p.accept_len[b] = length - 1;
}

template <int THREADS>
struct VerifyShared {
  BlockTopKShared<float, verify::kThresholdK, THREADS> sel_logits;
  BlockTopKShared<double, verify::kTopP, THREADS> sel_probs;
  double red_d[THREADS / kWarp];
  int64_t red_i[THREADS / kWarp];
  int64_t child, last_tried;  // the children test's outcome (thread 0 -> block)
  double total;
};

// Exclusive prefix sum of the threads' values in thread order (deterministic). Ends with a barrier.
JAKIRO_DEVICE double block_exclusive_sum(double v, double* scratch) {
  const int lane = lane_id();
  double x = v;  // inclusive within the warp
  for (int o = 1; o < kWarp; o *= 2) {
    const double y = warp_shfl(x, lane >= o ? lane - o : lane);
    if (lane >= o) x += y;
  }
  const double prev = warp_shfl(x, lane > 0 ? lane - 1 : 0);
  if (lane == kWarp - 1) scratch[warp_id()] = x;
  __syncthreads();
  double before = 0.0;
  for (int w = 0; w < warp_id(); ++w) before += scratch[w];
  __syncthreads();
  return lane > 0 ? before + prev : before;
}

// The filtered target distribution of one node (unnormalised weights) into w, returns its
// total mass, or -1 when the logits give none: CPU filtered_distribution. Block-wide.
template <int THREADS, typename scalar_t>
JAKIRO_DEVICE double filtered_distribution(const scalar_t* l, int64_t V, const VerifyParams& p, double* w,
                                           VerifyShared<THREADS>& sh) {
  using namespace verify;
  const double temperature = p.temperature;
  // Each thread touches w[i] for i = threadIdx.x + j * THREADS in every pass below (the
  // selection asks for the same indices), so these passes need no barrier between them.
  auto load_logit = [&](int64_t i) { return to_float(l[i]); };
  auto load_w = [&](int64_t i) { return w[i]; };
  // Scaled from the largest logit, z = (logit - max) / temperature is never above 0: a
  // temperature so small that logit / temperature would overflow gives the argmax distribution.
  double m = neg_inf_d(), bad = 0.0;
  strided_for<THREADS>(V, load_logit, [&](int64_t, float x) {
    if (poisons(x)) bad = 1.0;
    m = x > m ? x : m;
  });
  const double max_logit = block_reduce(m, sh.red_d, [](double a, double b) { return a > b ? a : b; });
  if (block_sum(bad, sh.red_d) > 0.0 || max_logit == neg_inf_d()) return -1.0;  // no distribution
  strided_for<THREADS>(V, load_logit, [&](int64_t i, float x) {
    w[i] = (static_cast<double>(x) - max_logit) / temperature;
  });

  // Top-k: keep the tokens reaching the k-th largest z (ties kept). z = logit / temperature is
  // monotone in the float logit, so the k-th largest z is that of the k-th largest logit.
  double threshold = neg_inf_d();
  if (p.top_k > 0 && p.top_k < V) {
    const int64_t k = p.top_k;
    float kth = 0.f;
    if (k <= kThresholdRounds * kThresholdK) {  // a few selection rounds
      block_topk<kThresholdK, THREADS>(
          V, k,
          [&](int64_t i, float& v) {
            v = to_float(l[i]);
            return true;
          },
          sh.sel_logits,
          [&](int64_t rank, float v, int64_t) {
            if (rank == k - 1) kth = v;
            return true;
          });
    } else {
      // Larger k: bisect the order-preserving keys of the logits for the smallest key t with
      // fewer than k logits above it, which is the k-th largest's key (exact: counts).
      uint32_t lo = 0, hi = 0xffffffffu;
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        int64_t c = 0;
        strided_for<THREADS>(V, load_logit, [&](int64_t, float x) { c += order_key(x) > mid; });
        if (block_sum(c, sh.red_i) < k) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      kth = from_order_key(lo);
    }
    threshold = (static_cast<double>(kth) - max_logit) / temperature;
  }

  double s = 0.0;
  strided_for<THREADS>(V, load_w, [&](int64_t i, double z) {
    const double e = z >= threshold ? exp(z) : 0.0;
    w[i] = e;
    s += e;
  });
  const double sum = block_sum(s, sh.red_d);
  strided_for<THREADS>(V, load_w, [&](int64_t i, double x) { w[i] = x / sum; });

  // Top-p: tokens most probable first (ties: lower id) while the mass before them is < top_p.
  // Every thread sums the winners' mass in rank order, as the CPU does, so all agree on the
  // first token dropped; it and every token ranked after it are zeroed.
  if (p.top_p < 1.0) {
    const double top_p = p.top_p;
    double mass = 0.0, cut_v = 0.0;
    int64_t cut_i = -1, visited = 0;
    auto visit = [&](int64_t, double v, int64_t i) {
      if (mass >= top_p) {
        cut_v = v;
        cut_i = i;
        return false;
      }
      mass += v;
      ++visited;
      return true;
    };
    // One round first: a peaked distribution reaches top_p within it.
    block_topk<kTopP, THREADS>(
        V, kTopP,
        [&](int64_t i, double& v) {
          v = w[i];
          return v > 0.0;
        },
        sh.sel_probs, visit);
    if (cut_i < 0 && visited == kTopP) {
      // A flat one: bisect (over float thresholds) for the smallest tau whose mass above,
      // S(tau), is < top_p. Every token above tau is kept (the mass before it is at most
      // S(tau) minus its own), so the rounds go on from mass S(tau) among the tokens <= tau:
      // at most those that round to tau as float, and one more.
      uint32_t lo = 0, hi = 0x7f800000u;  // +0 and +inf as float bits; S(inf) = 0 < top_p
      double s_hi = 0.0;
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        const double tau = static_cast<double>(float_from_bits(mid));
        double part = 0.0;
        strided_for<THREADS>(V, load_w, [&](int64_t, double x) { part += x > tau ? x : 0.0; });
        const double s_mid = block_sum(part, sh.red_d);
        if (s_mid < top_p) {
          hi = mid;
          s_hi = s_mid;
        } else {
          lo = mid + 1;
        }
      }
      const double tau = static_cast<double>(float_from_bits(hi));
      mass = s_hi;
      block_topk<kTopP, THREADS>(
          V, V,
          [&](int64_t i, double& v) {
            v = w[i];
            return v > 0.0 && v <= tau;
          },
          sh.sel_probs, visit);
    }
    if (cut_i >= 0) {
      strided_for<THREADS>(V, load_w, [&](int64_t i, double x) {
        if (x > 0.0 && !ranks_before(x, i, cut_v, cut_i)) w[i] = 0.0;
      });
    }
  }
  double t = 0.0;
  strided_for<THREADS>(V, load_w, [&](int64_t, double x) { t += x; });
  return block_sum(t, sh.red_d);  // its barriers publish w to the whole block
}

// Inverse CDF in token order: the first token whose cumulative mass exceeds u * total; the
// last token with mass if rounding leaves none; -1 if no token has mass. Block-wide; threads
// own contiguous chunks of the vocabulary.
template <int THREADS>
JAKIRO_DEVICE int64_t block_sample_from(const double* w, int64_t V, double total, double u,
                                        VerifyShared<THREADS>& sh) {
  const int64_t chunk = ceil_div(V, THREADS);
  const int64_t lo = threadIdx.x * chunk < V ? threadIdx.x * chunk : V;
  const int64_t hi = lo + chunk < V ? lo + chunk : V;
  double s = 0.0;
  for (int64_t i = lo; i < hi; ++i) s += w[i];
  double cum = block_exclusive_sum(s, sh.red_d);
  const double target = u * total;
  int64_t first = V, last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    const double x = w[i];
    if (x <= 0.0) continue;
    cum += x;
    last = i;
    if (cum > target) {
      first = i;
      break;
    }
  }
  first = block_reduce(first, sh.red_i, [](int64_t a, int64_t b) { return a < b ? a : b; });
  last = block_reduce(last, sh.red_i, [](int64_t a, int64_t b) { return a > b ? a : b; });
  return first < V ? first : last;
}

// One block of THREADS threads per sequence: the sampling walk (CPU sampling_walk).
template <typename scalar_t, int THREADS>
__global__ void __launch_bounds__(THREADS) verify_sampling_kernel(VerifyParams p) {
  __shared__ VerifyShared<THREADS> sh;
  const int64_t b = blockIdx.x, T = p.nodes, V = p.vocab;
  const int64_t* parents = p.parents + b * T;
  const int64_t* tokens = p.tokens + b * T;
  const scalar_t* logits = static_cast<const scalar_t*>(p.logits) + b * T * V;
  const double* u = p.uniforms + b * (T + 1);
  double* w = p.weights + b * V;
  int64_t* path = p.path + b * T;
  if (threadIdx.x == 0) {
    path[0] = 0;
    report_bad_tree(p, b);
  }
  int64_t node = 0, length = 1;  // the same in every thread
  while (true) {
    const double total = filtered_distribution(logits + node * V, V, p, w, sh);
    if (total < 0.0) {  // block-uniform
      if (threadIdx.x == 0) p.accept_len[b] = abandon_walk(path, length, p.bonus + b) - 1;
      break;
    }
    if (threadIdx.x == 0) {
      const ChildrenTest test = test_children(parents, tokens, T, node, u, total, w, V);
      sh.child = test.accepted;
      sh.last_tried = test.last_tried;
      sh.total = test.mass_left;
    }
    __syncthreads();
    int64_t accepted = sh.child;
    const int64_t last_tried = sh.last_tried;
    const double left = sh.total;
    if (accepted < 0) {
      const int64_t token = block_sample_from(w, V, left, u[T], sh);
      accepted = child_rounding_rejected(token, last_tried);
      if (accepted < 0) {
        if (threadIdx.x == 0) {
          p.bonus[b] = token;
          p.accept_len[b] = length - 1;
        }
        break;
      }
    }
    if (threadIdx.x == 0) path[length] = accepted;
    ++length;
    node = accepted;
  }
}

template <typename scalar_t>
void launch_verify_tree(const VerifyParams& p, cudaStream_t stream) {
  using namespace verify;
  if (p.batch == 0) return;
  if (p.temperature > 0.0) {
    if (p.vocab >= kWideVocab) {
      JAKIRO_LAUNCH(p.batch, kWideThreads, 0, stream, verify_sampling_kernel<scalar_t, kWideThreads>)(p);
    } else {
      JAKIRO_LAUNCH(p.batch, kThreads, 0, stream, verify_sampling_kernel<scalar_t, kThreads>)(p);
    }
    return;
  }
  const int64_t wanted = (p.vocab + kWarp - 1) / kWarp * kWarp;  // (ceil_div is device-only)
  const int threads = static_cast<int>(wanted < kMaxThreads ? wanted : kMaxThreads);
  JAKIRO_LAUNCH(p.batch * p.nodes, threads, 0, stream, verify_argmax_kernel<scalar_t>)(p);
  JAKIRO_LAUNCH((p.batch + kWalkThreads - 1) / kWalkThreads, kWalkThreads, 0, stream, verify_greedy_walk_kernel<scalar_t>)(p);
}

}  // namespace jakiro::gpu
