// CPU kernel of jakiro::rms_norm: the residual add and RMSNorm of a decoder layer in one pass
// over each row (eight ATen calls in eager code, each a dispatch and a pass over the row).
// Rounded where the checkpoints' code rounds: the sum to x's dtype, the normalised value to x's
// dtype before the weight; the sum of squares in float32, one fixed order per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu/layer_rows.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

constexpr int64_t kRowsPerTask = 16;

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                const std::optional<at::Tensor>& residual) {
  check_rms_norm(x, weight, eps, residual);
  const int64_t H = x.size(-1), rows = x.numel() / H;
  auto xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor rc = residual.has_value() ? residual->contiguous() : at::Tensor();
  auto out = at::empty(x.sizes(), xc.options()), sum = at::empty(x.sizes(), xc.options());
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "rms_norm_cpu", [&] {
    const scalar_t* px = xc.data_ptr<scalar_t>();
    const scalar_t* pr = rc.defined() ? rc.data_ptr<scalar_t>() : nullptr;
    const scalar_t* pw = wc.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    scalar_t* ps = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t r0, int64_t r1) {
      std::vector<float> s(H);
      for (int64_t r = r0; r < r1; ++r) {
        rms_norm_row(px + r * H, pr == nullptr ? nullptr : pr + r * H, pw, H, static_cast<float>(eps), po + r * H,
                     ps + r * H, s.data());
      }
    });
  });
  return {out, sum};
}

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }

}  // namespace jakiro::cpu
