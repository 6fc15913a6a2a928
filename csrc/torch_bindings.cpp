// The `jakiro` op library (schemas: op_schemas.h) and the Python module. Backends
// register their kernels beside the kernels (csrc/cpu/*.cpp, csrc/cuda/*.cu); the fake
// (meta) implementations are registered from Python (jakiro_ext/ops.py).
#include <Python.h>
#include <torch/library.h>

#include "cpu/kernels.h"
#include "cpu/skinny_avx512.h"
#include "op_schemas.h"

#ifndef TORCH_BUILD_VERSION
#define TORCH_BUILD_VERSION "unknown"
#endif

TORCH_LIBRARY(jakiro, m) { jakiro::define_ops(m); }

// A plain Python module so that `import jakiro_ext._C` loads the library (and its op
// registrations); it also records what it was built against.
namespace {

PyObject* cpu_avx512(PyObject*, PyObject*) { return PyBool_FromLong(jakiro::cpu::avx512_enabled()); }
PyObject* cpu_bf16_dot(PyObject*, PyObject*) { return PyBool_FromLong(jakiro::cpu::bf16_dot_enabled()); }
PyObject* cpu_onednn(PyObject*, PyObject*) { return PyBool_FromLong(jakiro::cpu::onednn_linear_enabled()); }
PyObject* cpu_weight_stream(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(jakiro::cpu::weight_stream_name());
  } catch (const c10::Error& e) {  // a bad JAKIRO_CPU_WEIGHT_STREAM
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"cpu_avx512", cpu_avx512, METH_NOARGS,
     "Whether float32 products on the CPU run on 512-bit vectors (AVX-512; off with JAKIRO_CPU_AVX512=0)."},
    {"cpu_bf16_dot", cpu_bf16_dot, METH_NOARGS,
     "Whether bf16 products on the CPU use native bf16 dot instructions (AVX512-BF16; off with JAKIRO_CPU_BF16_DOT=0)."},
    {"cpu_onednn", cpu_onednn, METH_NOARGS,
     "Whether a prompt's float32 products on the CPU go to torch's oneDNN (off with JAKIRO_CPU_ONEDNN=0)."},
    {"cpu_weight_stream", cpu_weight_stream, METH_NOARGS,
     "How the CPU's 512-bit products read a weight: zen5, zen4 or intel (the CPU's, or JAKIRO_CPU_WEIGHT_STREAM's)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "jakiro_ext compiled ops", -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  PyModule_AddStringConstant(module, "torch_version", TORCH_BUILD_VERSION);
  PyModule_AddIntConstant(module, "schema_version", jakiro::kSchemaVersion);
#ifdef JAKIRO_WITH_CUDA
  PyModule_AddIntConstant(module, "with_cuda", 1);
#else
  PyModule_AddIntConstant(module, "with_cuda", 0);
#endif
  return module;
}
