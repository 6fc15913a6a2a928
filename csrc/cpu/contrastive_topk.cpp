// CPU kernel of the fused (contrastive) LM head: feature -> logits over the vocabulary ->
// log-softmax -> top-k, streaming over the vocabulary.
//
// The LM head is cut into chunks of kVocabChunk rows; each worker takes a contiguous range of
// chunks and keeps, per feature row, an online log-sum-exp and a top-k list. Only one
// [rows, kVocabChunk] block of logits exists per worker at a time; the workers' states are
// merged at the end. For few rows the op is bound by reading the LM head, which is streamed
// once in its own dtype (skinny_gemm.h; a bf16 block widened into an L1 scratch); 16+ float32
// rows go to BLAS (cpu/gemm.h). The feature rows are float32 whatever h_a's dtype, so a bf16
// LM head beside float32 features is the path bf16 features take. A packed quantized LM head (a
// GGUF target's own rows: 0.27x float32's bytes in Q8_0) takes the features quantized per row
// and the integer products of jakiro::linear (cpu/quantized.h): its logits are the linear op's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/gemm.h"
#include "cpu/quantized.h"
#include "cpu/vec_utils.h"
#include "jakiro/softmax.h"
#include "jakiro/topk.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

constexpr int64_t kVocabChunk = 512;

struct RowState {
  std::vector<OnlineSoftmax> softmax;
  std::vector<float> top_values;
  std::vector<int64_t> top_indices;
  std::vector<TopK> top;
  RowState(int64_t rows, int64_t k) : softmax(rows), top_values(rows * k), top_indices(rows * k) {
    for (int64_t r = 0; r < rows; ++r) top.emplace_back(top_values.data() + r * k, top_indices.data() + r * k, k);
  }
};

// The feature rows in float32: h_a, or w_hi * h_a - w_lo * h_b.
at::Tensor feature_rows(const at::Tensor& h_a, const std::optional<at::Tensor>& h_b,
                        const std::optional<at::Tensor>& contrast_weight) {
  const int64_t H = h_a.size(-1);
  auto f = h_a.reshape({-1, H}).to(at::kFloat).contiguous();
  if (!h_b.has_value()) return f;
  auto w = contrast_weight->reshape({-1, 2}).to(at::kFloat);
  return (w.select(1, 0).unsqueeze(1) * f - w.select(1, 1).unsqueeze(1) * h_b->reshape({-1, H}).to(at::kFloat))
      .contiguous();
}

// The states of the vocabulary rows [v_begin, v_end); chunk_logits(v0, n, logits) writes the
// logits [rows, n] of rows [v0, v0 + n).
template <typename ChunkLogits>
void scan_vocab(int64_t rows, int64_t v_begin, int64_t v_end, const ChunkLogits& chunk_logits, RowState& st) {
  std::vector<float> logits(rows * kVocabChunk);
  for (int64_t v0 = v_begin; v0 < v_end; v0 += kVocabChunk) {
    const int64_t n = std::min(kVocabChunk, v_end - v0);
    chunk_logits(v0, n, logits.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* l = logits.data() + r * n;
      const float chunk_max = max_of(l, n);
      OnlineSoftmax& softmax = st.softmax[r];
      if (poisons(chunk_max)) softmax.poison();  // a NaN or +inf logit: the row gives NaN / -1
      if (softmax.poisoned()) continue;
      if (chunk_max != neg_inf()) {  // -inf logits add no mass (but stay candidates)
        softmax.rescale_for(chunk_max);
        softmax.sum += exp_shift_sum(l, n, softmax.max);
      }
      TopK& top = st.top[r];
      for (int64_t j = 0; j < n; ++j) {
        if (l[j] >= top.threshold()) top.push(l[j], v0 + j);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> contrastive_topk_cpu(const at::Tensor& h_a, const std::optional<at::Tensor>& h_b,
                                                        const std::optional<at::Tensor>& contrast_weight,
                                                        const at::Tensor& lm_head, int64_t k) {
  check_contrastive_topk(h_a, h_b, contrast_weight, lm_head, k, /*bf16_weights=*/true);
  const bool packed = lm_head.scalar_type() == at::kByte;
  const int64_t H = h_a.size(-1), V = packed ? lm_head.size(0) * kQuantLanes : lm_head.size(0);
  auto f = feature_rows(h_a, h_b, contrast_weight);
  const int64_t rows = f.size(0);
  auto w = lm_head.contiguous();

  // One state per part; parts are contiguous chunk ranges, about two per thread.
  const int64_t chunks = (V + kVocabChunk - 1) / kVocabChunk;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(chunks, 2 * at::get_num_threads()));
  std::vector<RowState> states;
  states.reserve(parts);
  for (int64_t p = 0; p < parts; ++p) states.emplace_back(rows, k);
  const auto scan_parts = [&](const auto& chunk_logits) {
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c0 = chunks * p / parts, c1 = chunks * (p + 1) / parts;
        scan_vocab(rows, c0 * kVocabChunk, std::min(V, c1 * kVocabChunk), chunk_logits, states[p]);
      }
    });
  };
  if (packed) {  // the features quantized once, as the linear op's activations (cpu/quantized.h)
    QuantizedRows xq;
    xq.quantize(f.data_ptr<float>(), rows, H);
    const QuantFormat format = quant_format_of_chunk(w.size(2));
    const int64_t group_bytes = w.size(1) * w.size(2);  // 16 vocabulary rows
    const uint8_t* pw = w.data_ptr<uint8_t>();
    scan_parts([&](int64_t v0, int64_t n, float* logits) {
      quantized_columns(xq, pw + v0 / kQuantLanes * group_bytes, format, nullptr, 0, n, logits, n);
    });
  } else {
    JAKIRO_DISPATCH_FLOAT_BF16(lm_head.scalar_type(), "contrastive_topk_cpu", [&] {
      const scalar_t* pw = w.data_ptr<scalar_t>();
      const float* pf = f.data_ptr<float>();
      scan_parts([&](int64_t v0, int64_t n, float* logits) {
        rows_times_weight(pf, rows, H, pw, H, H, v0, v0 + n, logits, n);
      });
    });
  }

  auto lead = h_a.sizes().slice(0, h_a.dim() - 1).vec();
  lead.push_back(k);
  auto logprobs = at::empty(lead, f.options());
  auto ids = at::empty(lead, f.options().dtype(at::kLong));
  float* plp = logprobs.data_ptr<float>();
  int64_t* pid = ids.data_ptr<int64_t>();
  std::vector<float> values(k);
  std::vector<int64_t> indices(k);
  for (int64_t r = 0; r < rows; ++r) {
    float max_all = neg_inf();
    bool poisoned = false;
    for (auto& s : states) {
      max_all = std::max(max_all, s.softmax[r].max);
      poisoned |= s.softmax[r].poisoned();
    }
    float sum = 0.f;
    TopK top(values.data(), indices.data(), k);
    for (auto& s : states) {
      if (s.softmax[r].sum > 0.f) sum += s.softmax[r].sum * std::exp(s.softmax[r].max - max_all);
      for (int64_t j = 0; j < s.top[r].count; ++j) top.push(s.top_values[r * k + j], s.top_indices[r * k + j]);
    }
    // No distribution (a NaN or +inf logit, or every logit -inf): NaN log-probabilities, token -1.
    const bool no_distribution = poisoned || sum == 0.f;
    const float lse = max_all + std::log(sum);
    for (int64_t j = 0; j < k; ++j) {
      plp[r * k + j] = no_distribution ? quiet_nan() : values[j] - lse;
      pid[r * k + j] = no_distribution ? -1 : indices[j];
    }
  }
  return {logprobs, ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("contrastive_topk", &contrastive_topk_cpu); }

}  // namespace jakiro::cpu
