// The per-node rules of lossless sampling verification, shared by the CPU walk
// (cpu/verify_tree.cpp) and the GPU walk (cuda/kernels/verify_tree.cuh). Framework-free,
// host/device. Recursive rejection with q = 1 (EAGLE-2 / SpecInfer style): at a node whose
// filtered target distribution is w (unnormalised, `total` its mass), the children are tried in
// index order; child c with token x is accepted when uniforms[c] * mass_left < w[x], otherwise
// w[x] is removed from the distribution and the next child is tried. A child repeating an earlier
// sibling's token is skipped (its mass was already tested). If no child is accepted the bonus
// token is drawn from what is left by inverse CDF with uniforms[T]. Each node is tested at most
// once per step, which is why T + 1 draws suffice.
#pragma once

#include "jakiro/common.h"
#include "jakiro/tree.h"

namespace jakiro {

// What the children test at one node found: the accepted child (-1: none), the last child it
// rejected (-1: none) and the mass left after the rejected children's removal.
struct ChildrenTest {
  int64_t accepted;
  int64_t last_tried;
  double mass_left;
};

// Tests `node`'s children against the distribution w[0..vocab) of mass `total`, removing each
// rejected child's token from w. A token outside the vocabulary weighs 0 (the GPU does not check
// token ids before the walk; the CPU refuses them before it).
JAKIRO_HOST_DEVICE ChildrenTest test_children(const int64_t* parents, const int64_t* tokens, int64_t num_nodes,
                                              int64_t node, const double* uniforms, double total, double* w,
                                              int64_t vocab) {
  ChildrenTest result{-1, -1, total};
  for (int64_t c = next_child(parents, num_nodes, node, node); c >= 0; c = next_child(parents, num_nodes, node, c)) {
    if (is_duplicate_sibling(parents, tokens, node, c)) continue;
    const int64_t x = tokens[c];
    const bool valid = x >= 0 && x < vocab;
    const double wx = valid ? w[x] : 0.0;
    if (uniforms[c] * result.mass_left < wx) {
      result.accepted = c;
      return result;
    }
    result.mass_left -= wx;
    if (valid) w[x] = 0.0;
    result.last_tried = c;
  }
  return result;
}

// After every child was rejected, the bonus token drawn from the mass left (`drawn`, -1 when no
// token has mass left). No mass left with a child tried means the rejected children held all
// of it and only rounding rejected the last one, which the exact test accepts with probability
// 1: the walk goes on to that child. Returns the child to go on to, or -1 to stop with `drawn`.
JAKIRO_HOST_DEVICE int64_t child_rounding_rejected(int64_t drawn, int64_t last_tried) {
  return drawn < 0 ? last_tried : -1;
}

}  // namespace jakiro
