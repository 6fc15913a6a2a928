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
