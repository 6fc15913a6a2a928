// Argument validation shared by every backend's torch glue: one message style that names
// the argument, what was expected and what was given.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "jakiro/quant.h"

namespace jakiro {

inline std::string dtype_list(std::initializer_list<at::ScalarType> dtypes) {
  std::ostringstream os;
  bool first = true;
  for (auto d : dtypes) {
    os << (first ? "" : " or ") << d;
    first = false;
  }
  return os.str();
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim, const char* layout) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions ", layout, ", got shape ",
              t.sizes());
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        std::initializer_list<at::ScalarType> dtypes) {
  for (auto d : dtypes) {
    if (t.scalar_type() == d) return;
  }
  TORCH_CHECK(false, op, ": ", name, " must have dtype ", dtype_list(dtypes), ", got ", t.scalar_type());
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ", ref_name, " (",
              ref.scalar_type(), "), got ", t.scalar_type());
}

// t of ref's dtype, or where the kernels take it (`allowed`: the CPU's) bfloat16 beside float32 ref.
inline void check_bf16_beside_float(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                                    const at::Tensor& ref, bool allowed) {
  const bool mixed = t.scalar_type() == at::kBFloat16 && ref.scalar_type() == at::kFloat;
  if (mixed && allowed) return;
  TORCH_CHECK(!mixed, op, ": ", name, " in bfloat16 beside float32 ", ref_name, " is read by the CPU kernels only; here ",
              name, " must have the dtype of ", ref_name, " (Float)");
  check_same_dtype(op, name, t, ref_name, ref);
}

// A product's weight: the dtype of its activations ref, or, where the kernel reads them
// (`bf16_weights`: the CPU's), bfloat16 beside float32 activations: a bf16 checkpoint's weights
// kept at their own precision and widened exactly in registers (float32 arithmetic, half the
// bytes read, the bits of the same weights in float32).
inline void check_weight_dtype(const char* op, const char* name, const at::Tensor& w, const char* ref_name,
                               const at::Tensor& ref, bool bf16_weights) {
  check_bf16_beside_float(op, name, w, ref_name, ref, bf16_weights);
}

// A KV cache: the dtype of its activations ref, or, where the kernels take it (`bf16_cache`: the
// CPU's), bfloat16 beside float32 activations (a quantized target's cache: half the bytes every
// row's attention reads; keys and values rounded to bf16 as they are written, widened exactly as
// they are read, the arithmetic float32).
inline void check_cache_dtype(const char* op, const char* name, const at::Tensor& cache, const char* ref_name,
                              const at::Tensor& ref, bool bf16_cache) {
  check_bf16_beside_float(op, name, cache, ref_name, ref, bf16_cache);
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t expected,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == expected, op, ": ", name, ".shape[", dim, "] (", what, ") must be ", expected,
              ", got ", t.size(dim), " (shape ", t.sizes(), ")");
}

// A product's weight as a matrix [N, K] (`layout` names it): a 2-dimensional tensor, or where the
// kernel reads them (`packed_weights`: the CPU's) a packed quantized weight [N / 16, K / 32, 16 B]
// uint8 beside float32 activations ref (jakiro/quant.h). Returns (N, K).
inline std::pair<int64_t, int64_t> check_weight_matrix(const char* op, const char* name, const at::Tensor& w,
                                                       const char* layout, const char* ref_name, const at::Tensor& ref,
                                                       bool packed_weights) {
  if (w.scalar_type() != at::kByte) {
    check_dim(op, name, w, 2, layout);
    return {w.size(0), w.size(1)};
  }
  TORCH_CHECK(packed_weights, op, ": ", name, " is a packed quantized weight (uint8), which only the CPU kernels ",
              "read; dequantize it for ", ref.device(), " (jakiro_ext.ops.quantized.dequantize)");
  TORCH_CHECK(ref.scalar_type() == at::kFloat, op, ": a packed quantized ", name, " takes float32 ", ref_name,
              ", got ", ref.scalar_type());
  TORCH_CHECK(w.dim() == 3 && quant_format_of_chunk(w.size(2)) != QuantFormat::kNone, op, ": ", name,
              " in uint8 must be a packed quantized weight [N / 16, K / 32, 16 B] with 16 B = 288 (Q4_0), 320 (Q4_1) ",
              "or 544 (Q8_0) (jakiro_ext.ops.quantized.pack), got shape ", w.sizes());
  return {w.size(0) * kQuantLanes, w.size(1) * kQuantBlock};
}

inline void check_weight_size(const char* op, const char* name, const at::Tensor& w, int64_t dim, int64_t got,
                              int64_t expected, const char* what) {
  if (w.scalar_type() != at::kByte) return check_size(op, name, w, dim, expected, what);
  TORCH_CHECK(got == expected, op, ": ", name, "'s ", dim == 0 ? "rows" : "columns", " (", what, ") must be ",
              expected, ", got ", got, " (packed, shape ", w.sizes(), ")");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the other inputs, got ",
              t.device());
}

}  // namespace jakiro
