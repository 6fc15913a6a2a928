// The portable device layer of the GPU kernels (csrc/cuda/kernels/*.cuh), framework-free.
// One kernel source builds three ways:
//   * nvcc (CUDA), warp width 32;
//   * hipcc after `torch.utils.hipify` (HIP on AMD CDNA), warp width 64;
//   * g++ -DSIMT_EMU (csrc/simt/simt_emu.h): the kernels run on the CPU, warp width
//     SIMT_WARP_SIZE (32 or 64), for tests without a GPU.
// Kernels use only what is here plus plain CUDA C++ (__global__, __shared__, threadIdx,
// __syncthreads, atomics), and tensor cores only through the WMMA API (CUDA and the emulator; HIP keeps
// the CUDA-core kernels): no PTX, async copies or grid-wide sync.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(SIMT_EMU)
#include "simt/simt_emu.h"
#define JAKIRO_WARP_SIZE SIMT_WARP_SIZE
#elif defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define JAKIRO_WARP_SIZE 64  // CDNA wavefronts (MI200/MI300)
#else
#include <cuda_runtime.h>
#define JAKIRO_WARP_SIZE 32
#endif

#include "jakiro/common.h"
#include "jakiro/dtype.h"
#include "jakiro/softmax.h"

#define JAKIRO_DEVICE __device__ __forceinline__

// Dynamic shared memory of a kernel as a `T*` named `name`: 128-byte aligned, as WMMA's fragment
// loads and stores need (32 bytes at least; 16 is what a plain declaration is promised).
#if defined(SIMT_EMU)
#define JAKIRO_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::simt::dynamic_shared_memory())
#else
#define JAKIRO_DYNAMIC_SMEM(T, name)                               \
  extern __shared__ __align__(128) unsigned char jakiro_smem_[]; \
  T* name = reinterpret_cast<T*>(jakiro_smem_)
#endif

// Launch: JAKIRO_LAUNCH(grid, block, shared_bytes, stream, kernel<...>)(args...).
#if defined(SIMT_EMU)
#define JAKIRO_LAUNCH(grid, block, smem, stream, ...) ::simt::launcher(__VA_ARGS__, dim3(grid), dim3(block), smem)
#else
#define JAKIRO_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#endif

namespace jakiro::gpu {

constexpr int kWarp = JAKIRO_WARP_SIZE;

// The most blocks a launch's grid may have along y or z (CUDA rejects more). Kernels whose z
// grows with the input launch in chunks of this many; the emulated build uses 3 so that every
// test with more row blocks than that runs the chunked launches.
#if defined(SIMT_EMU)
constexpr int64_t kMaxGridYZ = 3;
#else
constexpr int64_t kMaxGridYZ = 65535;
#endif

JAKIRO_DEVICE int lane_id() { return static_cast<int>(threadIdx.x) % kWarp; }
JAKIRO_DEVICE int warp_id() { return static_cast<int>(threadIdx.x) / kWarp; }
JAKIRO_DEVICE int num_warps() { return static_cast<int>(blockDim.x) / kWarp; }

// Orders the shared-memory accesses of the lanes of a warp (a warp-level barrier).
JAKIRO_DEVICE void warp_sync() {
#if defined(__HIPCC__)
  // A wavefront runs in lockstep: the barrier orders the compiler, the fences the LDS accesses.
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// Whole-warp shuffles (every lane of the warp must take part).
template <typename T>
JAKIRO_DEVICE T warp_shfl_xor(T v, int lane_mask) {
#if defined(__HIPCC__)
  return __shfl_xor(v, lane_mask, kWarp);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}
template <typename T>
JAKIRO_DEVICE T warp_shfl(T v, int src_lane) {
#if defined(__HIPCC__)
  return __shfl(v, src_lane, kWarp);
#else
  return __shfl_sync(0xffffffffu, v, src_lane);
#endif
}

template <typename T>
JAKIRO_DEVICE T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += warp_shfl_xor(v, o);
  return v;
}
JAKIRO_DEVICE float silu(float g) { return g / (1.f + expf(-g)); }

JAKIRO_DEVICE float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, warp_shfl_xor(v, o));
  return v;
}

// Block-wide reductions; every thread gets the result. `scratch` is shared memory of at least
// num_warps() elements; blockDim.x must be a multiple of the warp width. Ends with a barrier,
// so the scratch can be reused at once.
template <typename T, typename Op>
JAKIRO_DEVICE T block_reduce(T v, T* scratch, Op op) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = op(v, warp_shfl_xor(v, o));
  if (lane_id() == 0) scratch[warp_id()] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < num_warps(); ++w) r = op(r, scratch[w]);
  __syncthreads();
  return r;
}
template <typename T>
JAKIRO_DEVICE T block_sum(T v, T* scratch) {
  return block_reduce(v, scratch, [](T a, T b) { return a + b; });
}
JAKIRO_DEVICE float block_max(float v, float* scratch) {
  return block_reduce(v, scratch, [](float a, float b) { return fmaxf(a, b); });
}

// a * b and a + b, each rounded: never contracted into a fused multiply-add (nvcc contracts by
// default), so that a kernel rounds where eager PyTorch code does.
JAKIRO_DEVICE float mul_rn(float a, float b) {
#if defined(SIMT_EMU)
  return a * b;  // g++ -std=c++20 does not contract
#else
  return __fmul_rn(a, b);
#endif
}
JAKIRO_DEVICE float add_rn(float a, float b) {
#if defined(SIMT_EMU)
  return a + b;
#else
  return __fadd_rn(a, b);
#endif
}

// 16 bytes in one load (a 16-byte-aligned address): the vector loads of the streaming kernels.
struct alignas(16) Pack16 {
  uint32_t u[4];
};
JAKIRO_DEVICE Pack16 load16(const void* p) {
#if defined(SIMT_EMU)
  Pack16 v;
  memcpy(&v, p, sizeof v);
  return v;
#else
  return *static_cast<const Pack16*>(p);
#endif
}
JAKIRO_DEVICE bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Full unrolling of a fixed-trip loop keeps its small arrays in registers (nvcc otherwise leaves
// some bf16 unpacking in local memory). Nothing to ask g++ under the emulator.
#if defined(SIMT_EMU)
#define JAKIRO_UNROLL
#else
#define JAKIRO_UNROLL _Pragma("unroll")
#endif

// The elements of a 16-byte load as floats, into out[at, at + 16 / sizeof(T)) (T: the pointer's
// element type, float or bf16).
template <int N>
JAKIRO_DEVICE void unpack_to(const Pack16& v, float (&out)[N], int at, const float*) {
  JAKIRO_UNROLL
  for (int e = 0; e < 4; ++e) memcpy(&out[at + e], &v.u[e], sizeof(float));
}
template <int N>
JAKIRO_DEVICE void unpack_to(const Pack16& v, float (&out)[N], int at, const bf16*) {
  JAKIRO_UNROLL
  for (int e = 0; e < 8; ++e) out[at + e] = to_float(bf16{static_cast<uint16_t>(v.u[e / 2] >> (16 * (e % 2)))});
}

JAKIRO_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bits of the device's error word (read and cleared by jakiro::device_errors). A kernel that
// meets one of these bad index values, which the CPU ops reject on the host (on a GPU a host
// check would cost a synchronisation per call), skips the memory accesses the value would
// direct and sets the bit; jakiro_ext/ops.py holds the message of each.
enum DeviceError : int32_t {
  kBadPrefixLens = 1,  // tree_attention: prefix_lens[b] outside [0, capacity - T]: no key read
  kBadLengths = 2,     // rope_kv_write: lengths[b] outside [0, capacity - T]: k, v not written
  kBadPath = 4,        // compact_kv: prefix_lens, path_len or path out of range: the sequence not moved
  kBadParents = 8,     // verify_tree: parents not a tree in topological order
  kBadTokens = 16,     // verify_tree: a draft token id outside the vocabulary
  kBadUniforms = 32,   // verify_tree: a uniform outside [0, 1)
  kBadRows = 64,       // dequantize_rows: a row outside the weight: its values NaN
};
JAKIRO_DEVICE void report_error(int32_t* word, DeviceError e) { atomicOr(word, static_cast<int32_t>(e)); }

}  // namespace jakiro::gpu
