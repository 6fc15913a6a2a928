// CPU kernel of the merge of split-KV partial attention states: per (sequence, token, head)
// row, the splits' outputs weighted by exp(lse_s - max lse), renormalised; the merged lse is
// max lse + log(sum of weights). An empty split (lse -inf) contributes nothing; a NaN or +inf
// lse poisons the row (NaN out), as in the reference.
#include "cpu/merge_attention_states.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace jakiro::cpu {

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& out_partial,
                                                              const at::Tensor& lse_partial,
                                                              std::optional<at::ScalarType> out_dtype) {
  const auto dtype = check_merge_attention_states(out_partial, lse_partial, out_dtype);
  auto op_c = out_partial.contiguous();
  auto lse_c = lse_partial.contiguous();
  const int64_t B = op_c.size(0), T = op_c.size(1), H = op_c.size(2), S = op_c.size(3), D = op_c.size(4);
  auto out = at::empty({B, T, H, D}, op_c.options().dtype(dtype));
  auto lse = at::empty({B, T, H}, lse_c.options());
  const float* po = op_c.data_ptr<float>();
  const float* pl = lse_c.data_ptr<float>();
  float* plse = lse.data_ptr<float>();
  JAKIRO_DISPATCH_FLOAT_BF16(dtype, "merge_attention_states_cpu", [&] {
    scalar_t* pout = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * T * H, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t row = begin; row < end; ++row) {
        merge_attention_row(po + row * S * D, pl + row * S, S, D, acc.data(), pout + row * D, plse + row);
      }
    });
  });
  return {out, lse};
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("merge_attention_states", &merge_attention_states_cpu); }

}  // namespace jakiro::cpu
