// The `jakiro` op library (schemas: op_schemas.h) and the Python module. Backends
// register their kernels beside the kernels (csrc/cpu/*.cpp, csrc/cuda/*.cu); the fake
// (meta) implementations are registered from Python (jakiro_ext/ops.py).
#include <Python.h>
#include <torch/library.h>

#include "op_schemas.h"

#ifndef TORCH_BUILD_VERSION
#define TORCH_BUILD_VERSION "unknown"
#endif

TORCH_LIBRARY(jakiro, m) { jakiro::define_ops(m); }

// A plain Python module so that `import jakiro_ext._C` loads the library (and its op
// registrations); it also records what it was built against.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "jakiro_ext compiled ops", -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  PyModule_AddStringConstant(module, "torch_version", TORCH_BUILD_VERSION);
#ifdef JAKIRO_WITH_CUDA
  PyModule_AddIntConstant(module, "with_cuda", 1);
#else
  PyModule_AddIntConstant(module, "with_cuda", 0);
#endif
  return module;
}
