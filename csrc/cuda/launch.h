// Torch glue of the GPU kernels: the stream, the device guard, the launch check, the element
// type mapping and where the kernels register. Under SIMT_EMU the same glue registers the
// kernels, run on the CPU by the emulator, for CPU tensors under a namespace of their own
// (JAKIRO_SIMT_NAMESPACE, e.g. jakiro_simt32), so that tests compare them with the references.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "cuda/device.h"
#include "cuda/wmma.h"

#if defined(SIMT_EMU)
#ifndef JAKIRO_SIMT_NAMESPACE
#error "SIMT_EMU builds name their op namespace: -DJAKIRO_SIMT_NAMESPACE=jakiro_simt32"
#endif
#define JAKIRO_GPU_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(JAKIRO_SIMT_NAMESPACE, CPU, m)
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define JAKIRO_GPU_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(jakiro, CUDA, m)
#endif

namespace jakiro::gpu {

// The element type a kernel sees for a torch scalar type (same bits).
template <typename scalar_t>
struct device_type {
  using type = scalar_t;
};
template <>
struct device_type<c10::BFloat16> {
  using type = bf16;
};
template <typename scalar_t>
using device_t = typename device_type<scalar_t>::type;

template <typename scalar_t>
device_t<scalar_t>* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<device_t<scalar_t>*>(t.data_ptr<scalar_t>());
}

// Makes `t`'s device current for the scope and gives its stream.
class DeviceScope {
 public:
#if defined(SIMT_EMU)
  explicit DeviceScope(const at::Tensor&) {}
  cudaStream_t stream() const { return cudaStream_t{}; }
#else
  explicit DeviceScope(const at::Tensor& t) : guard_(t.device()) {}
  cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream().stream(); }

 private:
  c10::cuda::CUDAGuard guard_;
#endif
};

// Streaming multiprocessors of the current device (the emulator reports 8): sizes split-KV grids.
inline int64_t multiprocessor_count() {
#if defined(SIMT_EMU)
  return 8;
#else
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
#endif
}

// Whether the tensor-core kernels may run on `t`'s device: built with WMMA (CUDA or the
// emulator; HIP keeps the CUDA-core kernels), a device with bf16 WMMA (sm_80+), and
// JAKIRO_GPU_TENSOR_CORES not "0" (the switch that compares them with the CUDA-core kernels).
inline bool tensor_cores_enabled(const at::Tensor& t) {
#if defined(JAKIRO_HAS_WMMA)
  const char* env = std::getenv("JAKIRO_GPU_TENSOR_CORES");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
#if defined(SIMT_EMU)
  (void)t;
  return true;
#else
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, t.get_device()));
  return major >= 8;
#endif
#else
  (void)t;
  return false;
#endif
}

// The device's error word (DeviceError bits) for the kernels to report to: one int32 per
// device (under the emulator, one for the CPU), allocated on first use and never moved, so a
// captured CUDA graph keeps reporting to it.
int32_t* error_word(const at::Tensor& like);

inline void check_launch() {
#if !defined(SIMT_EMU)
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#endif
}

}  // namespace jakiro::gpu
