// CPU kernel of tree verification: greedy (the target's argmax), and lossless sampling on the
// filtered target distribution by the rules of jakiro/sampling.h (recursive rejection, q = 1).
//
// Sampling at a node: p = filter(softmax(logits / temperature)) (top-k, then top-p), built here
// one node at a time; the children test and the bonus draw follow jakiro/sampling.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/skinny_avx512.h"  // (JAKIRO_HAVE_AVX512_KERNELS, avx512_enabled)
#ifdef JAKIRO_HAVE_AVX512_KERNELS
#include <immintrin.h>
#endif

#include "jakiro/sampling.h"
#include "jakiro/softmax.h"
#include "jakiro/tree.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

struct SamplingParams {
  double temperature, top_p;
  int64_t top_k;
};

// Top-p: keeps the tokens, most probable first (ties: lower id first), while the mass before them
// is < top_p, and zeroes the others. The kept tokens are a prefix of that order, so only the
// tokens at or above the power of two t whose mass reaches top_p are sorted (t from the weights'
// mass per octave), not the whole vocabulary (sorting a growing prefix of all 49,152 tokens took
// 1.5 of 1.8 ms a node at T = 1, top-p 0.9: half a quantized model's step). Their prefix sums are the
// same sums in the same order; where rounding leaves the prefix short of top_p, every token with
// mass is sorted, as before.
void keep_top_p(std::vector<double>& w, double top_p, std::vector<int64_t>& order) {
  const int64_t V = static_cast<int64_t>(w.size());
  auto before = [&](int64_t a, int64_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
  constexpr int kOctaves = 1100;  // w in (0, 1]: ilogb(w) in [-1074, 0]
  std::vector<double> octave_mass(kOctaves, 0.0);
  for (int64_t i = 0; i < V; ++i)
    if (w[i] > 0.0) octave_mass[std::min(kOctaves - 1, -std::ilogb(w[i]))] += w[i];
  double mass_at = 0.0;
  int octave = 0;
  while (octave < kOctaves - 1 && (mass_at += octave_mass[octave]) < top_p) ++octave;
  double t = std::ldexp(1.0, -octave);  // every token of octaves 0 .. octave is >= t
  int64_t keep = 0;
  for (;;) {
    order.clear();
    for (int64_t i = 0; i < V; ++i)
      if (w[i] > 0.0 && w[i] >= t) order.push_back(i);
    std::sort(order.begin(), order.end(), before);
    double mass = 0.0;
    for (keep = 0; keep < static_cast<int64_t>(order.size()) && mass < top_p; ++keep) mass += w[order[keep]];
    if (mass >= top_p || t == 0.0) break;
    t = 0.0;  // (rounding: the prefix's sum fell short of top_p; every token with mass, as before)
  }
  std::vector<double> kept(keep);
  for (int64_t j = 0; j < keep; ++j) kept[j] = w[order[j]];
  std::fill(w.begin(), w.end(), 0.0);
  for (int64_t j = 0; j < keep; ++j) w[order[j]] = kept[j];
}

// Writes the filtered target distribution (unnormalised weights) to `w`, returns its total
// mass, or -1 when the logits give no distribution (a NaN or +inf logit, or all -inf). Top-k keeps every token whose logit reaches the k-th largest (ties kept); top-p keeps
// tokens, most probable first (ties: lower id first), while the mass before them is < top_p.
template <typename scalar_t>
double filtered_distribution(const scalar_t* logits, int64_t V, const SamplingParams& sp, std::vector<double>& w,
                             std::vector<int64_t>& order) {
  w.resize(V);
  // Scaled from the largest logit, (logit - max) / temperature is never above 0: a temperature
  // so small that logit / temperature would overflow gives the limit, the argmax distribution.
  float max_logit = neg_inf();
  for (int64_t i = 0; i < V; ++i) {
    const float x = static_cast<float>(logits[i]);
    if (poisons(x)) return -1.0;  // a NaN or +inf logit: no distribution
    max_logit = x > max_logit ? x : max_logit;
  }
  if (max_logit == neg_inf()) return -1.0;  // every logit -inf
  for (int64_t i = 0; i < V; ++i)
    w[i] = (static_cast<double>(static_cast<float>(logits[i])) - max_logit) / sp.temperature;
  double threshold = -std::numeric_limits<double>::infinity();
  if (sp.top_k > 0 && sp.top_k < V) {
    std::vector<double> copy(w);
    std::nth_element(copy.begin(), copy.begin() + (sp.top_k - 1), copy.end(), std::greater<double>());
    threshold = copy[sp.top_k - 1];
  }
  double sum = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    w[i] = w[i] >= threshold ? std::exp(w[i]) : 0.0;
    sum += w[i];
  }
  for (int64_t i = 0; i < V; ++i) w[i] /= sum;
  if (sp.top_p < 1.0) keep_top_p(w, sp.top_p, order);
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += w[i];
  return total;
}

// Inverse CDF in token order: first token whose cumulative mass exceeds u * total; -1 if no
// token has mass left.
int64_t sample_from(const std::vector<double>& w, double total, double u) {
  const double target = u * total;
  double cum = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i) {
    if (w[i] <= 0.0) continue;
    cum += w[i];
    last = i;
    if (cum > target) return i;
  }
  return last;  // rounding left the target at the very end
}

template <typename scalar_t>
int64_t sampling_walk(const int64_t* parents, const int64_t* tokens, int64_t T, const scalar_t* logits, int64_t V,
                      const double* u, const SamplingParams& sp, int64_t* path, int64_t* bonus) {
  std::vector<double> w;
  std::vector<int64_t> order;
  int64_t node = 0, length = 0;
  path[length++] = 0;
  while (true) {
    const double total = filtered_distribution(logits + node * V, V, sp, w, order);
    if (total < 0.0) return abandon_walk(path, length, bonus);
    const ChildrenTest test = test_children(parents, tokens, T, node, u, total, w.data(), V);
    int64_t accepted = test.accepted;
    if (accepted < 0) {
      const int64_t token = sample_from(w, test.mass_left, u[T]);
      accepted = child_rounding_rejected(token, test.last_tried);
      if (accepted < 0) {
        *bonus = token;
        return length;
      }
    }
    path[length++] = accepted;
    node = accepted;
  }
}

#ifdef JAKIRO_HAVE_AVX512_KERNELS
#pragma GCC push_options
#pragma GCC target("avx512f")
// argmax_at of a float32 row on 512-bit vectors: its largest value (and whether a value poisons)
// in one pass, then the first index holding it (a node's scan of 49,152 logits: 5x less time).
int64_t argmax_avx512(const float* row, int64_t V) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 top = _mm512_set1_ps(neg_inf());
  __mmask16 poisoned = 0;
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    poisoned |= _mm512_cmp_ps_mask(v, inf, _CMP_NLT_UQ);  // !(v < inf), as poisons(): NaN or +inf
    top = _mm512_max_ps(v, top);
  }
  float best_v = _mm512_reduce_max_ps(top);
  for (int64_t j = i; j < V; ++j) {
    if (poisons(row[j])) return -1;
    best_v = std::max(best_v, row[j]);
  }
  if (poisoned != 0 || best_v == neg_inf()) return -1;
  const __m512 best = _mm512_set1_ps(best_v);
  for (i = 0; i + 16 <= V; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), best, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  for (; row[i] != best_v; ++i) {
  }
  return i;
}
#pragma GCC pop_options
#endif

// The target's greedy token (ties: the lowest id), or -1 when the row gives no distribution
// (a NaN or +inf logit, or every logit -inf).
template <typename scalar_t>
int64_t argmax_at(const scalar_t* row, int64_t V) {
#ifdef JAKIRO_HAVE_AVX512_KERNELS
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (avx512_enabled()) return argmax_avx512(row, V);
  }
#endif
  int64_t best = 0;
  float best_v = static_cast<float>(row[0]);
  for (int64_t i = 0; i < V; ++i) {
    const float v = static_cast<float>(row[i]);
    if (poisons(v)) return -1;
    if (v > best_v) {
      best_v = v;
      best = i;
    }
  }
  return best_v == neg_inf() ? -1 : best;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_cpu(const at::Tensor& parents,
                                                               const at::Tensor& draft_tokens,
                                                               const at::Tensor& target_logits,
                                                               const std::optional<at::Tensor>& uniforms,
                                                               double temperature, double top_p, int64_t top_k) {
  check_verify_tree(parents, draft_tokens, target_logits, uniforms, temperature, top_p, top_k);
  const int64_t B = parents.size(0), T = parents.size(1), V = target_logits.size(2);
  auto par = parents.contiguous(), tok = draft_tokens.contiguous(), logits = target_logits.contiguous();
  auto path = at::full({B, T}, -1, parents.options());
  auto accept_len = at::empty({B}, parents.options());
  auto bonus = at::empty({B}, parents.options());
  at::Tensor u = temperature > 0.0 ? uniforms->contiguous() : at::Tensor();
  const SamplingParams sp{temperature, top_p, top_k};
  JAKIRO_DISPATCH_FLOAT_BF16(logits.scalar_type(), "verify_tree_cpu", [&] {
    const scalar_t* pl = logits.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t* pp = par.data_ptr<int64_t>() + b * T;
        const int64_t* pt = tok.data_ptr<int64_t>() + b * T;
        const scalar_t* lb = pl + b * T * V;
        int64_t* out_path = path.data_ptr<int64_t>() + b * T;
        int64_t* out_bonus = bonus.data_ptr<int64_t>() + b;
        int64_t length;
        if (temperature > 0.0) {
          length = sampling_walk(pp, pt, T, lb, V, u.data_ptr<double>() + b * (T + 1), sp, out_path, out_bonus);
        } else {
          auto choice = [&](int64_t node) { return argmax_at(lb + node * V, V); };
          length = greedy_walk(pp, pt, T, choice, out_path, out_bonus);
        }
        accept_len.data_ptr<int64_t>()[b] = length - 1;
      }
    });
  });
  check_verify_result(target_logits, accept_len);
  return {path, accept_len, bonus};
}

}  // namespace

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("verify_tree", &verify_tree_cpu); }

}  // namespace jakiro::cpu
