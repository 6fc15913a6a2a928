// CPU kernel of jakiro::rms_norm: the residual add and RMSNorm of a decoder layer in one pass
// over each row (eight ATen calls in eager code, each a dispatch and a pass over the row).
// Rounded where the checkpoints' code rounds: the sum to x's dtype, the normalised value to x's
// dtype before the weight; the sum of squares in float32, one fixed order per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu/vec_utils.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

constexpr int64_t kRowsPerTask = 16;

template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, int64_t H, float eps,
                  scalar_t* out, scalar_t* sum, float* s) {
  for (int64_t i = 0; i < H; ++i) {
    const scalar_t v = residual == nullptr ? x[i] : static_cast<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
    sum[i] = v;
    s[i] = static_cast<float>(v);
  }
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= H; i += Vec::size()) {
    const Vec v = Vec::loadu(s + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float squares = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < H; ++i) squares = std::fma(s[i], s[i], squares);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j) {
    const scalar_t normed = static_cast<scalar_t>(s[j] * inv);
    out[j] = static_cast<scalar_t>(static_cast<float>(normed) * static_cast<float>(weight[j]));
  }
}

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
