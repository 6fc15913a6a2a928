// Tests of the framework-free kernel headers that the CPU and GPU kernels share: online
// softmax, split merge, top-k selection, tree walks and mask bits. No torch needed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "jakiro/common.h"
#include "jakiro/softmax.h"
#include "jakiro/topk.h"
#include "jakiro/tree.h"

static int failures = 0;
#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::printf("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                    \
    }                                                                \
  } while (0)

static bool close(double a, double b, double tol = 1e-5) { return std::fabs(a - b) <= tol * (1 + std::fabs(b)); }

static void online_softmax_matches_direct_lse() {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> scores(1000);
  for (auto& s : scores) s = normal(rng);
  double mx = *std::max_element(scores.begin(), scores.end()), sum = 0;
  for (float s : scores) sum += std::exp(s - mx);
  const double direct = mx + std::log(sum);

  jakiro::OnlineSoftmax st;
  for (size_t b = 0; b < scores.size(); b += 97) {  // uneven blocks
    const size_t e = std::min(scores.size(), b + 97);
    const float block_max = *std::max_element(scores.begin() + b, scores.begin() + e);
    st.rescale_for(block_max);
    for (size_t i = b; i < e; ++i) st.sum += std::exp(scores[i] - st.max);
  }
  CHECK(close(st.lse(), direct));
  CHECK(jakiro::OnlineSoftmax{}.lse() == jakiro::neg_inf());  // nothing seen
}

static void merge_weights_combine_splits() {
  // lse of the whole = log(sum_s exp(lse_s)); empty splits (-inf) weigh nothing.
  const float lses[] = {1.5f, jakiro::neg_inf(), -0.25f, 3.0f};
  const float mx = 3.0f;
  double total = 0;
  for (float l : lses) total += jakiro::merge_weight(l, mx);
  CHECK(close(mx + std::log(total), std::log(std::exp(1.5) + std::exp(-0.25) + std::exp(3.0))));
  CHECK(jakiro::merge_weight(jakiro::neg_inf(), mx) == 0.f);
}

static void topk_keeps_the_best_in_order() {
  std::mt19937 rng(2);
  std::uniform_int_distribution<int> small(0, 20);  // many ties
  std::vector<float> values(500);
  for (auto& v : values) v = static_cast<float>(small(rng));
  for (int64_t k : {1, 7, 500}) {
    std::vector<float> tv(k);
    std::vector<int64_t> ti(k);
    jakiro::TopK top(tv.data(), ti.data(), k);
    for (int64_t i = 0; i < 500; ++i) top.push(values[i], i);
    std::vector<int64_t> order(500);
    for (int64_t i = 0; i < 500; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return values[a] > values[b]; });
    CHECK(top.count == k);
    for (int64_t j = 0; j < k; ++j) CHECK(ti[j] == order[j] && tv[j] == values[order[j]]);
  }
}

static void greedy_walk_follows_the_target() {
  // 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 4 -> {6}
  const int64_t parents[] = {-1, 0, 0, 1, 1, 2, 4};
  const int64_t tokens[] = {9, 10, 11, 12, 13, 14, 15};
  const int64_t choice[] = {10, 13, 0, 0, 15, 0, 77};  // target's token at each node
  int64_t path[7], bonus = -1;
  auto target = [&](int64_t node) { return choice[node]; };
  const int64_t n = jakiro::greedy_walk(parents, tokens, 7, target, path, &bonus);
  CHECK(n == 4 && path[0] == 0 && path[1] == 1 && path[2] == 4 && path[3] == 6 && bonus == 77);
  CHECK(jakiro::next_child(parents, 7, 1, 1) == 3 && jakiro::next_child(parents, 7, 1, 3) == 4);
  CHECK(jakiro::next_child(parents, 7, 1, 4) == -1 && jakiro::next_child(parents, 7, 3, 3) == -1);
  const int64_t dup_tokens[] = {9, 10, 10, 12, 13, 14, 15};
  CHECK(jakiro::is_duplicate_sibling(parents, dup_tokens, 0, 2) && !jakiro::is_duplicate_sibling(parents, dup_tokens, 0, 1));
}

static void mask_bits_span_words() {
  int64_t row[3] = {0, 0, 0};
  for (int64_t j : {0, 63, 64, 130}) row[j / 64] |= static_cast<int64_t>(uint64_t{1} << (j % 64));
  CHECK(jakiro::mask_words(1) == 1 && jakiro::mask_words(64) == 1 && jakiro::mask_words(65) == 2);
  for (int64_t j = 0; j < 192; ++j) CHECK(jakiro::mask_bit(row, j) == (j == 0 || j == 63 || j == 64 || j == 130));
}

int main() {
  online_softmax_matches_direct_lse();
  merge_weights_combine_splits();
  topk_keeps_the_best_in_order();
  greedy_walk_follows_the_target();
  mask_bits_span_words();
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
