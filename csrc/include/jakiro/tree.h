// Tree walks shared by the verification kernels (CPU and GPU). Framework-free, host/device.
//
// A draft tree of T nodes is given by `parents[T]`: node 0 is the root (parent -1), every
// other node's parent has a smaller index. The children of a node, in index order, are its
// siblings' order of preference.
#pragma once

#include "jakiro/common.h"

namespace jakiro {

// Next child of `node` after index `after` (pass `node` to get the first child), or -1.
// O(T) per call; trees are small (tens of nodes) and the walk visits at most depth+1 nodes.
JAKIRO_HOST_DEVICE int64_t next_child(const int64_t* parents, int64_t num_nodes, int64_t node, int64_t after) {
  for (int64_t c = after + 1; c < num_nodes; ++c) {
    if (parents[c] == node) return c;
  }
  return -1;
}

// Is `token` already the token of an earlier child of `node` (before child `child`)?
// Such duplicates are skipped: their probability mass was already tested.
JAKIRO_HOST_DEVICE bool is_duplicate_sibling(const int64_t* parents, const int64_t* tokens, int64_t node,
                                             int64_t child) {
  for (int64_t c = node + 1; c < child; ++c) {
    if (parents[c] == node && tokens[c] == tokens[child]) return true;
  }
  return false;
}

// A walk that reached a node whose target logits give no distribution (a NaN or +inf logit, or
// every logit -inf): the sequence's result is no path (-1), bonus -1 and length 0, so
// accept_len = -1, never a token (README, "Non-finite values"). Returns 0.
JAKIRO_HOST_DEVICE int64_t abandon_walk(int64_t* path, int64_t length, int64_t* bonus) {
  for (int64_t i = 0; i < length; ++i) path[i] = -1;
  *bonus = -1;
  return 0;
}

// Greedy verification of one sequence's tree: follow, from the root, the child whose token
// equals the target's choice at its parent. `target_choice(node)` gives the target's token
// at a node (its argmax; -1 when its logits give none: the walk is abandoned). Writes the accepted node indices (root first) to `path` and
// returns their count; `*bonus` gets the target's token at the last accepted node.
template <class TargetChoice>
JAKIRO_HOST_DEVICE int64_t greedy_walk(const int64_t* parents, const int64_t* tokens, int64_t num_nodes,
                                       TargetChoice target_choice, int64_t* path, int64_t* bonus) {
  int64_t node = 0;
  int64_t length = 0;
  path[length++] = 0;
  while (true) {
    const int64_t want = target_choice(node);
    if (want < 0) return abandon_walk(path, length, bonus);
    int64_t next = -1;
    for (int64_t c = next_child(parents, num_nodes, node, node); c >= 0; c = next_child(parents, num_nodes, node, c)) {
      if (tokens[c] == want) {
        next = c;
        break;
      }
    }
    if (next < 0) {
      *bonus = want;
      return length;
    }
    path[length++] = next;
    node = next;
  }
}

}  // namespace jakiro
