// Tensor cores through the WMMA API (nvcuda::wmma), for the kernels that use them: on CUDA
// (bf16 fragments need sm_80), and under the SIMT emulator, which has the 16x16x16 bf16 -> float
// subset. HIP keeps the CUDA-core kernels: JAKIRO_HAS_WMMA is left undefined there.
#pragma once

#include "cuda/device.h"

#if defined(SIMT_EMU) || !defined(__HIPCC__)
#define JAKIRO_HAS_WMMA 1
#if !defined(SIMT_EMU)
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace jakiro::gpu {

namespace wmma = nvcuda::wmma;

constexpr int kTcTile = 16;  // WMMA tile: 16 x 16 x 16
constexpr int kTcPad = 8;    // bf16 padding of a staged row: ldm stays a multiple of 8, banks spread

// The fragments the kernels use: bf16 A (row-major) and B (either layout), float accumulators.
using TcFragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using TcFragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using TcFragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using TcFragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// The kernels' bf16 as the WMMA API's type (the same bits).
JAKIRO_DEVICE const __nv_bfloat16* tc_ptr(const bf16* x) { return reinterpret_cast<const __nv_bfloat16*>(x); }

}  // namespace jakiro::gpu

#endif
