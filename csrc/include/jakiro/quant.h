// The quantized weight formats the CPU products read: GGML's Q4_0, Q4_1 and Q8_0 blocks (32
// weights along K with a float16 scale; Q4_1 also a float16 minimum), their rows interleaved 16
// at a time so that a 512-bit vector holds one value of each of 16 output rows. Framework-free:
// the checks (validate.cpp) and the kernels (cpu/quantized.cpp) read the same layout.
//
// A packed weight is a uint8 tensor [N / 16, K / 32, 16 * B] (B: the format's bytes per row block,
// 18, 20 or 34, so its last dimension names the format). Chunk [g, b] holds block b of rows
// 16 g .. 16 g + 15 ("lanes"):
//   Q4_0: d[16] float16 | codes (256 bytes)                  w = d (c - 8), c in [0, 16)
//   Q4_1: d[16] float16 | m[16] float16 | codes (256 bytes)  w = d c + m,   c in [0, 16)
//   Q8_0: d[16] float16 | codes (512 bytes)                  w = d (c - 128), c in [1, 256) (GGML's int8 + 128)
// The codes come as 64-byte vectors of 16 lanes x 4 bytes. Q8_0: vector p holds each lane's
// weights 4p .. 4p + 3 of the block. Q4: vector p (p < 4) holds, in each byte's low nibble, weights
// 4p .. 4p + 3 and in its high nibble weights 16 + 4p .. 16 + 4p + 3: GGML's own byte qs[4p + i]
// of that row's block. The activations are quantized per row in blocks of 32 as GGML's
// quantize_row_q8 does (jakiro_ext.ops.quantized holds the layout's pure-PyTorch twin).
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "jakiro/common.h"

namespace jakiro {

enum class QuantFormat : int { kNone = 0, kQ4_0 = 1, kQ4_1 = 2, kQ8_0 = 3 };

constexpr int64_t kQuantBlock = 32;  // weights per block, along K
constexpr int64_t kQuantLanes = 16;  // output rows interleaved in a packed chunk

// Bytes a row's block takes in GGML's format (the chunk is kQuantLanes times that).
constexpr int64_t quant_block_bytes(QuantFormat f) {
  switch (f) {
    case QuantFormat::kQ4_0: return 18;
    case QuantFormat::kQ4_1: return 20;
    case QuantFormat::kQ8_0: return 34;
    default: return 0;
  }
}

// The format whose chunks are `chunk_bytes` long (a packed weight's last dimension); kNone if none.
inline QuantFormat quant_format_of_chunk(int64_t chunk_bytes) {
  for (QuantFormat f : {QuantFormat::kQ4_0, QuantFormat::kQ4_1, QuantFormat::kQ8_0})
    if (chunk_bytes == kQuantLanes * quant_block_bytes(f)) return f;
  return QuantFormat::kNone;
}

// What a block's integer dot product subtracts per unit of the activations' code sum: the codes'
// offset from the weights' signed values (Q4_1's minimum is a separate term).
constexpr int32_t quant_code_offset(QuantFormat f) {
  return f == QuantFormat::kQ4_0 ? 8 : f == QuantFormat::kQ8_0 ? 128 : 0;
}

// Bytes before the codes in a chunk: the scales (and Q4_1's minimums), float16 per lane.
constexpr int64_t quant_scale_bytes(QuantFormat f) { return (f == QuantFormat::kQ4_1 ? 2 : 1) * kQuantLanes * 2; }

// An IEEE float16 (GGML's scales and minimums, little-endian bytes) as float: exact, the same on
// every host and device (subnormals, infinities and NaN included).
JAKIRO_HOST_DEVICE float quant_half(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | mantissa << 13;  // infinity, NaN
  } else if (exponent != 0) {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;  // normal: the exponent's bias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal, mantissa * 2^-24: normalized
    uint32_t shifts = 0;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      ++shifts;
    }
    bits = sign | (113 - shifts) << 23 | (mantissa & 0x3FFu) << 13;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

// The unsigned code of weight e (< 32) of lane `lane`'s block, in a chunk's codes (the layout above).
template <QuantFormat F>
JAKIRO_HOST_DEVICE int32_t quant_code(const uint8_t* codes, int64_t lane, int64_t e) {
  if constexpr (F == QuantFormat::kQ8_0) {
    return codes[64 * (e / 4) + 4 * lane + e % 4];
  } else {
    const int64_t i = e % 16;
    const uint8_t byte = codes[64 * (i / 4) + 4 * lane + i % 4];
    return e < 16 ? byte & 0x0F : byte >> 4;
  }
}

// A weight as GGML dequantizes it from its block's scale d (and Q4_1's minimum m) and its code c:
// d (c - offset), or d c + m (Q4_1). (d times a code is exact in float32: 11 significant bits
// times at most 8; a fused multiply-add gives the same bits.)
template <QuantFormat F>
JAKIRO_HOST_DEVICE float quant_value(float d, float m, int32_t c) {
  if constexpr (F == QuantFormat::kQ4_1) {
    return d * static_cast<float>(c) + m;
  } else {
    return d * static_cast<float>(c - quant_code_offset(F));
  }
}

// Lane `lane`'s block of a chunk: its scale and (Q4_1) minimum.
template <QuantFormat F>
JAKIRO_HOST_DEVICE float quant_scale(const uint8_t* chunk, int64_t lane) { return quant_half(chunk + 2 * lane); }
template <QuantFormat F>
JAKIRO_HOST_DEVICE float quant_min(const uint8_t* chunk, int64_t lane) {
  return F == QuantFormat::kQ4_1 ? quant_half(chunk + 2 * kQuantLanes + 2 * lane) : 0.f;
}

// Weight e (< 32) of lane `lane`'s block in a chunk, dequantized (quant_value).
template <QuantFormat F>
JAKIRO_HOST_DEVICE float quant_weight(const uint8_t* chunk, int64_t lane, int64_t e) {
  return quant_value<F>(quant_scale<F>(chunk, lane), quant_min<F>(chunk, lane),
                        quant_code<F>(chunk + quant_scale_bytes(F), lane, e));
}

}  // namespace jakiro
