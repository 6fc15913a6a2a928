// Argument validation shared by every backend's torch glue: one message style that names
// the argument, what was expected and what was given.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <sstream>
#include <string>

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

// A product's weight: the dtype of its activations ref, or, where the kernel reads them
// (`bf16_weights`: the CPU's), bfloat16 beside float32 activations: a bf16 checkpoint's weights
// kept at their own precision and widened exactly in registers (float32 arithmetic, half the
// bytes read, the bits of the same weights in float32).
inline void check_weight_dtype(const char* op, const char* name, const at::Tensor& w, const char* ref_name,
                               const at::Tensor& ref, bool bf16_weights) {
  const bool mixed = w.scalar_type() == at::kBFloat16 && ref.scalar_type() == at::kFloat;
  if (mixed && bf16_weights) return;
  TORCH_CHECK(!mixed, op, ": ", name, " in bfloat16 beside float32 ", ref_name, " is read by the CPU kernels only; here ",
              name, " must have the dtype of ", ref_name, " (Float)");
  check_same_dtype(op, name, w, ref_name, ref);
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t expected,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == expected, op, ": ", name, ".shape[", dim, "] (", what, ") must be ", expected,
              ", got ", t.size(dim), " (shape ", t.sizes(), ")");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " like the other inputs, got ",
              t.device());
}

}  // namespace jakiro
