// CPU kernel of Jakiro's MoE feed-forward block (router with N + 2 logits, top-2 of N SwiGLU
// experts, weighted combination plus residual) in one call.
//
// Routing runs in float32 for every input dtype (the router is tiny and near-ties between
// experts must not depend on bf16 rounding). Tokens are then grouped by expert, and each
// active expert runs over just its tokens as three products (cpu/gemm.h: the weight streamed
// once for few tokens or bf16, BLAS for 16+ float32 rows) with SiLU(gate) * up fused in
// between, in float32 whatever the weights' dtype; the active experts run in parallel.
// Nothing is gathered per token. The experts' weights may be bf16 beside float32 activations (a
// bf16 checkpoint's, as drafting reads them: half the bytes, the same bits).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/vec_utils.h"
#include "jakiro/router.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

// g = silu(g) * u, element-wise.
void silu_mul_in_place(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  const Vec one(1.f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec x = Vec::loadu(g + i);
    (x / (one + x.neg().exp()) * Vec::loadu(u + i)).store(g + i);
  }
  for (; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// One expert over its tokens: rows = (token * 2 + slot) of expert_out, SwiGLU in float32. weight_t:
// scalar_t's, or bf16 beside float32 activations (widened in registers: the same weights' bits).
template <typename scalar_t, typename weight_t>
void run_expert(const scalar_t* x, const weight_t* w_gate, const weight_t* w_up, const weight_t* w_down,
                const std::vector<int64_t>& rows, int64_t H, int64_t I, scalar_t* expert_out) {
  const int64_t m = static_cast<int64_t>(rows.size());
  std::vector<float> xs(m * H), gate(m * I), up(m * I), y(m * H);
  for (int64_t r = 0; r < m; ++r) to_float(x + (rows[r] / 2) * H, xs.data() + r * H, H);
  rows_times_weight(xs.data(), m, H, w_gate, H, H, 0, I, gate.data(), I);
  rows_times_weight(xs.data(), m, H, w_up, H, H, 0, I, up.data(), I);
  silu_mul_in_place(gate.data(), up.data(), m * I);
  rows_times_weight(gate.data(), m, I, w_down, I, I, 0, H, y.data(), H);
  for (int64_t r = 0; r < m; ++r) from_float(y.data() + r * H, expert_out + rows[r] * H, H);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_top2_cpu(
    const at::Tensor& x, const at::Tensor& router_weight, const at::Tensor& w_gate, const at::Tensor& w_up,
    const at::Tensor& w_down, bool renormalize) {
  const auto sh = check_moe_top2(x, router_weight, w_gate, w_up, w_down, /*bf16_weights=*/true);
  const int64_t M = sh.tokens, H = sh.hidden, N = sh.experts;
  auto x2 = x.reshape({M, H}).contiguous();
  const MoeOutputs outputs = empty_moe_outputs(x);
  const at::Tensor &expert_out = outputs.expert_out, &expert_idx = outputs.expert_idx;
  const at::Tensor &expert_score = outputs.expert_score, &contrast_weight = outputs.contrast_weight;
  auto out = at::empty_like(x2);

  // Router: N routing logits + 2 contrastive logits per token, in float32.
  auto logits = at::mm(x2.to(at::kFloat), router_weight.to(at::kFloat).t()).contiguous();
  const float* pl = logits.data_ptr<float>();
  int64_t* pidx = expert_idx.data_ptr<int64_t>();
  float* pscore = expert_score.data_ptr<float>();
  float* pcw = contrast_weight.data_ptr<float>();
  std::vector<std::vector<int64_t>> rows_of(N);  // per expert: token * 2 + slot
  for (int64_t m = 0; m < M; ++m) {
    const Top2Route route = route_top2(pl + m * (N + 2), N, renormalize);
    for (int64_t j = 0; j < 2; ++j) {
      pidx[m * 2 + j] = route.expert[j];
      pscore[m * 2 + j] = route.score[j];
      pcw[m * 2 + j] = route.contrast_weight[j];
      if (route.valid()) rows_of[route.expert[j]].push_back(m * 2 + j);
    }
  }
  auto wg = w_gate.contiguous(), wu = w_up.contiguous(), wd = w_down.contiguous();
  const int64_t I = sh.intermediate;
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "moe_top2_cpu", [&] {
    scalar_t* peo = expert_out.data_ptr<scalar_t>();
    // Spread the active experts (not all N) over the threads: with one token, two experts.
    std::vector<int64_t> active;
    for (int64_t e = 0; e < N; ++e)
      if (!rows_of[e].empty()) active.push_back(e);
    auto experts = [&](auto* weights_of_type) {
      using weight_t = std::remove_pointer_t<decltype(weights_of_type)>;
      at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t e = active[i];
          run_expert(x2.data_ptr<scalar_t>(), wg.data_ptr<weight_t>() + e * I * H, wu.data_ptr<weight_t>() + e * I * H,
                     wd.data_ptr<weight_t>() + e * H * I, rows_of[e], H, I, peo);
        }
      });
    };
    if (wg.scalar_type() == x.scalar_type()) {
      experts(static_cast<scalar_t*>(nullptr));
    } else {  // bf16 experts beside float32 activations (check_moe_top2)
      experts(static_cast<at::BFloat16*>(nullptr));
    }
    // A token without routing (non-finite router logits) has NaN expert outputs.
    for (int64_t m = 0; m < M; ++m)
      if (pidx[m * 2] < 0) std::fill(peo + m * 2 * H, peo + (m + 1) * 2 * H, static_cast<scalar_t>(quiet_nan()));
    // out = x + score_0 * h_0 + score_1 * h_1, accumulated in float32.
    const scalar_t* px = x2.data_ptr<scalar_t>();
    const scalar_t* ph = peo;
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(H), h(H);
      for (int64_t m = begin; m < end; ++m) {
        to_float(px + m * H, acc.data(), H);
        for (int64_t j = 0; j < 2; ++j) {
          to_float(ph + (m * 2 + j) * H, h.data(), H);
          axpy(acc.data(), h.data(), H, pscore[m * 2 + j]);
        }
        from_float(acc.data(), po + m * H, H);
      }
    });
  });
  return {out.view(x.sizes()), expert_out, expert_idx, expert_score, contrast_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("moe_top2", &moe_top2_cpu); }

}  // namespace jakiro::cpu
