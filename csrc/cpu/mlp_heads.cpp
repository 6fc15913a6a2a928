// CPU kernel of jakiro::mlp_heads: Gumiho's parallel MLP heads in one call. Unfused, each of a
// head's 1 + NB layers is a linear call, then a SiLU and a residual add: three dispatches a
// layer and head, around weights that stream in tens of microseconds at drafting sizes. Here
// every layer of all the heads is one parallel region: its tasks (head, block of output columns)
// stream their weight rows once with jakiro::linear's skinny kernels and apply the bias, the
// SiLU and the residual to their block while it is in cache. The activations stay float32
// between layers (two buffers, as a layer reads the whole previous one); the output is rounded
// to x's dtype once. Rows go in passes of kLinearStreamRows, each row computed in the same order
// whatever the number of rows: a sequence's features do not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu/skinny_avx512.h"
#include "cpu/skinny_gemm.h"
#include "cpu/vec_utils.h"
#include "ops.h"

namespace jakiro::cpu {
namespace {

constexpr int64_t kColumnBlock = 64;  // output columns per task

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

at::Tensor mlp_heads_cpu(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& b_in,
                         const at::Tensor& w_blocks, const at::Tensor& b_blocks) {
  const MlpHeadsShape sh = check_mlp_heads(x, w_in, b_in, w_blocks, b_blocks);
  const int64_t M = sh.rows, K = sh.in_features, J = sh.heads, H = sh.hidden, NB = sh.blocks;
  auto out_shape = x.sizes().vec();
  out_shape.back() = J;
  out_shape.push_back(H);
  auto out = at::empty(out_shape, x.options());
  if (M == 0 || J == 0 || H == 0) return out;
  auto xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  auto wi = w_in.contiguous(), wb = w_blocks.contiguous();
  auto bi = b_in.to(at::kFloat).contiguous(), bb = b_blocks.to(at::kFloat).contiguous();
  const float* px = xf.data_ptr<float>();
  const float* pbi = bi.data_ptr<float>();
  const float* pbb = bb.data_ptr<float>();
  const int64_t pass_rows = std::min(M, kLinearStreamRows);
  std::vector<float> buffers(2 * J * pass_rows * H);  // [2][J][rows][H]: a layer's input and output
  const int64_t column_blocks = (H + kColumnBlock - 1) / kColumnBlock;
  const bool wide = avx512_enabled();
  JAKIRO_DISPATCH_FLOAT_BF16(x.scalar_type(), "mlp_heads_cpu", [&] {
    const scalar_t* pwi = wi.data_ptr<scalar_t>();
    const scalar_t* pwb = wb.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    for (int64_t m0 = 0; m0 < M; m0 += kLinearStreamRows) {
      const int64_t rows = std::min(kLinearStreamRows, M - m0);
      auto act = [&](int which, int64_t j) { return buffers.data() + (which * J + j) * rows * H; };
      // One layer of every head: y = input . W^T over the task's columns, then
      // out = (residual ? input : 0) + SiLU(y + bias), into the other buffer than `src`. Head j's
      // input rows start at in + j * in_head_stride (stride 0: x, which the heads share).
      auto layer = [&](const float* in, int64_t in_head_stride, int64_t in_features, const scalar_t* weights,
                       int64_t weight_stride, const float* bias, int64_t bias_stride, int src, bool residual) {
        at::parallel_for(0, J * column_blocks, 1, [&](int64_t t0, int64_t t1) {
          std::vector<float> y;
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t j = t / column_blocks, c0 = (t % column_blocks) * kColumnBlock;
            const int64_t c1 = std::min(H, c0 + kColumnBlock), n = c1 - c0;
            const float* rows_in = in + j * in_head_stride;
            const scalar_t* w = weights + j * weight_stride;
            y.resize(rows * n);
            if (wide)
              skinny_gemm_nt_avx512(rows_in, rows, in_features, w, in_features, in_features, c0, c1, y.data(), n);
            else
              skinny_gemm_nt(rows_in, rows, in_features, w, in_features, in_features, c0, c1, y.data(), n);
            const float* b = bias + j * bias_stride;
            float* dst = act(1 - src, j);
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t c = c0; c < c1; ++c) {
                const float v = silu(y[r * n + c - c0] + b[c]);
                dst[r * H + c] = residual ? rows_in[r * H + c] + v : v;
              }
            }
          }
        });
      };
      layer(px + m0 * K, 0, K, pwi, H * K, pbi, H, /*src=*/1, false);  // x, shared by the heads
      int src = 0;
      for (int64_t b = 0; b < NB; ++b, src = 1 - src) {
        layer(act(src, 0), rows * H, H, pwb + b * H * H, NB * H * H, pbb + b * H, NB * H, src, true);
      }
      for (int64_t j = 0; j < J; ++j) {
        const float* h = act(src, j);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < H; ++c) po[((m0 + r) * J + j) * H + c] = static_cast<scalar_t>(h[r * H + c]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jakiro, CPU, m) { m.impl("mlp_heads", &mlp_heads_cpu); }

}  // namespace jakiro::cpu
