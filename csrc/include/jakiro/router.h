// Top-2 routing of Jakiro's MoE block from the router's N + 2 float32 logits, shared by the
// CPU and GPU kernels. Framework-free, host/device.
#pragma once

#include "jakiro/softmax.h"
#include "jakiro/topk.h"

namespace jakiro {

struct Top2Route {
  int64_t expert[2];           // the two experts, higher score first (ties: lower index)
  float score[2];              // their softmax-over-N scores (renormalised to sum 1 if asked)
  float contrast_weight[2];    // softmax of the 2 extra logits, larger first
  JAKIRO_HOST_DEVICE bool valid() const { return expert[0] >= 0; }
};

// A token whose logits are not all finite has no routing: experts -1, NaN scores and weights
// (its outputs are NaN; README, "Non-finite values").
JAKIRO_HOST_DEVICE Top2Route route_top2(const float* logit, int64_t N, bool renormalize) {
  Top2Route route;
  bool finite = true;
  for (int64_t e = 0; e < N + 2; ++e) finite = finite && !poisons(logit[e]) && logit[e] != neg_inf();
  if (!finite) {
    for (int s = 0; s < 2; ++s) {
      route.expert[s] = -1;
      route.score[s] = route.contrast_weight[s] = quiet_nan();
    }
    return route;
  }
  float mx = logit[0];
  for (int64_t e = 1; e < N; ++e) mx = mx > logit[e] ? mx : logit[e];
  float probs[8], sum = 0.f;
  for (int64_t e = 0; e < N; ++e) sum += (probs[e] = expf(logit[e] - mx));
  TopK top(route.score, route.expert, 2);  // larger first, ties: the lower expert first
  for (int64_t e = 0; e < N; ++e) top.push(probs[e] / sum, e);
  const float norm = renormalize ? route.score[0] + route.score[1] : 1.f;
  for (int s = 0; s < 2; ++s) route.score[s] /= norm;
  const float c0 = logit[N], c1 = logit[N + 1], cm = c0 > c1 ? c0 : c1;
  const float e0 = expf(c0 - cm), e1 = expf(c1 - cm);
  route.contrast_weight[0] = (e0 > e1 ? e0 : e1) / (e0 + e1);
  route.contrast_weight[1] = (e0 > e1 ? e1 : e0) / (e0 + e1);
  return route;
}

}  // namespace jakiro
