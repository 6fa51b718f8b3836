// Shared by chunk_encode.cu and chunk_decode_add.cu: the value codecs of a chunked payload
// (csrc/README.md, selector="chunk"), bit streams written with atomics, guarded byte reads,
// and the block scans the encoder ranks entries with. Device twins of csrc/cpu/chunk_codecs.h:
// every function below is the CPU one written with bit operations and explicitly rounded
// float operations (__fdiv_rn, __fmul_rn, __fadd_rn, __fsub_rn: never contracted into an
// FMA, never flushed to zero), so that the bytes equal the CPU kernel's and the reference's.
//
// NaN bit patterns: GPU arithmetic returns one canonical NaN (0x7FFFFFFF) where x86 returns
// the NaN operand, so an acc that is NaN has other bits on the GPU than on the CPU, and so
// do the fp32 / fp16 codes written for it (the bf16 code of a NaN is 0xFFFF on both, as the
// CPU kernel writes it; scales of non-finite chunks are the constants 0x7FC0 / 0x7F80 on
// both). Every other bit is the same.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "chunk_format.h"  // csrc/cpu: host-only plain aggregate + sparsecomm::chunk_format
#include "radix_select.cuh"

namespace sparsecomm_cuda {

using sparsecomm::ChunkFormat;

constexpr uint32_t kInfKey = 0x7F800000u;  // keys >= this one: +-Inf and NaN
constexpr uint32_t kNanKey = 0x7F800001u;

__device__ __forceinline__ bool bits_finite(uint32_t bits) {
  return (bits & 0x7F800000u) != 0x7F800000u;
}
__device__ __forceinline__ bool bits_nan(uint32_t bits) {
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}
__device__ __forceinline__ bool float_finite(float x) {
  return bits_finite(__float_as_uint(x));
}
__device__ __forceinline__ bool float_nan(float x) {
  return bits_nan(__float_as_uint(x));
}

// ----- value codecs (chunk_codecs.h) ------------------------------------------------------

// bfloat16 rounding of a float32 >= 0, finite, in a stated direction.
__device__ __forceinline__ float bf16_round_up(float x) {
  return __uint_as_float((__float_as_uint(x) + 0xFFFFu) & ~0xFFFFu);
}
__device__ __forceinline__ float bf16_round_down(float x) {
  return __uint_as_float(__float_as_uint(x) & ~0xFFFFu);
}

__device__ __forceinline__ int32_t int_codec_qmax(int32_t codec) {
  return codec == sparsecomm::kValueInt8 ? 127 : codec == sparsecomm::kValueInt4 ? 7 : 1;
}

// What the encoder knows of a chunk's selection, from its keys alone (all entries with a
// key >= the k-th one: the ties at the k-th key not sent have the same magnitude as the one
// that is): the largest finite magnitude key (0 if none), the smallest non-zero finite one
// (UINT32_MAX if none), and 2 if a NaN is selected, 1 if an Inf (and no NaN), else 0.
struct ChunkStats {
  uint32_t largest;
  uint32_t smallest;
  uint32_t non_finite;
};

// chunk_codecs.h chunk_scale, from the stats: |v| of a finite entry is the float whose bits
// are its key, and the order of keys is the order of magnitudes.
__device__ __forceinline__ float chunk_scale(int32_t codec, const ChunkStats& s) {
  if (s.non_finite == 2) return __uint_as_float(0x7FC00000u);
  if (s.non_finite == 1) return __uint_as_float(0x7F800000u);
  const float largest = __uint_as_float(s.largest);
  switch (codec) {
    case sparsecomm::kValueFp8:
      return bf16_round_up(__fdiv_rn(largest, 448.0f));
    case sparsecomm::kValueInt8:
      return bf16_round_up(__fmul_rn(largest, 0.0078125f));  // 2^-7: exact (but for subnormals)
    case sparsecomm::kValueInt4:
      return bf16_round_up(__fmul_rn(largest, 0.125f));
    case sparsecomm::kValueInt2:
      return bf16_round_up(__fmul_rn(largest, 0.5f));
    default: {  // sign
      const float smallest = s.smallest == UINT32_MAX ? 0.0f : __uint_as_float(s.smallest);
      const float twice = __fmul_rn(2.0f, smallest);
      const float mean = __fadd_rn(__fdiv_rn(smallest, 2.0f), __fdiv_rn(largest, 2.0f));
      const float scale = bf16_round_down(mean < twice ? mean : twice);               // std::min
      const float floor = bf16_round_up(__fmul_rn(largest, 1.52587890625e-05f));       // 2^-16
      return scale < floor ? floor : scale;                                            // std::max
    }
  }
}

// The code of value v in a chunk of scale s (value_codecs._codes).
__device__ __forceinline__ uint32_t value_code(int32_t codec, float v, float s) {
  const uint32_t bits = __float_as_uint(v);
  const bool negative = (bits >> 31) != 0 && !bits_nan(bits);
  if (codec == sparsecomm::kValueSign) return negative ? 1u : 0u;
  const bool finite_scale = float_finite(s);
  if (codec == sparsecomm::kValueFp8) {
    float ratio = s > 0.0f ? __fdiv_rn(v, s) : 0.0f;
    ratio = ratio < -448.0f ? -448.0f : (ratio > 448.0f ? 448.0f : ratio);
    if (!finite_scale) ratio = negative ? -448.0f : 448.0f;
    return c10::Float8_e4m3fn(ratio).x;  // c10's bit-operation conversion, host and device alike
  }
  const int32_t qmax = int_codec_qmax(codec);
  const float limit = static_cast<float>(qmax);
  float q = s > 0.0f ? rintf(__fdiv_rn(v, s)) : 0.0f;  // nearbyint: to nearest, ties to even
  q = q < -limit ? -limit : (q > limit ? limit : q);
  if (!finite_scale) q = negative ? -limit : limit;
  return static_cast<uint32_t>(static_cast<int32_t>(q) + qmax);
}

// What a receiver adds for a code of a scaled codec (value_codecs.decode); a NaN scale is
// returned as it is (the CPU kernel's rule: its bits are 0x7FC00000 on every backend).
__device__ __forceinline__ float decode_code(int32_t codec, uint32_t code, float s) {
  float level;
  if (codec == sparsecomm::kValueSign) {
    level = code != 0 ? -1.0f : 1.0f;  // 1 - 2 * code, exact
  } else if (codec == sparsecomm::kValueFp8) {
    level = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
  } else {
    level = static_cast<float>(static_cast<int32_t>(code) - int_codec_qmax(codec));
  }
  if (float_nan(level)) return level;
  if (float_nan(s)) return s;
  return __fmul_rn(level, s);
}

// Float codecs: the wire bits of a float32 acc v (finite values beyond the dtype's range
// saturate: saturate() in radix_select.cuh), and the value they stand for. bf16 and fp16
// round to nearest even with bit operations (what torch's CPU conversion computes; CUDA's
// conversion instructions give the same bits for every non-NaN value).
__device__ __forceinline__ uint32_t float_wire_bits(int32_t codec, float v) {
  const uint32_t bits = __float_as_uint(v);
  if (codec == sparsecomm::kValueFp32) return bits;
  if (codec == sparsecomm::kValueBf16) {
    if (bits_nan(bits)) return 0xFFFFu;  // as the CPU kernel writes it
    const uint32_t u = __float_as_uint(saturate<float, c10::BFloat16>(v));
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // c10::detail::round_to_nearest_even
  }
  if (bits_nan(bits)) return ((bits >> 16) & 0x8000u) | 0x7E00u;  // c10's CPU conversion of a NaN
  return c10::Half(saturate<float, c10::Half>(v)).x;  // __float2half: round to nearest even
}

__device__ __forceinline__ float float_wire_value(int32_t codec, uint32_t bits) {
  if (codec == sparsecomm::kValueFp32) return __uint_as_float(bits);
  if (codec == sparsecomm::kValueBf16) return __uint_as_float(bits << 16);
  return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
}

// ----- bit streams (bitpack.py): bit i is bit i % 8 of byte i / 8 -------------------------
//
// The encoder zeroes the payload first and then only ORs bits into it, with 32-bit atomics
// (fields of neighbouring entries, and of neighbouring chunks written by other blocks, share
// bytes). Bit i of the stream is bit i % 32 of little-endian word i / 32, so a word address
// is the stream's base plus 4 * (i / 32): the base must be 4-byte aligned (the host encodes
// into an aligned scratch buffer when the payload is not). Only set bits are written, and
// every set bit lies in the payload, so no word outside it is touched.

// ORs the `nbits` (<= 32) low bits of value (< 2^nbits) into the stream at bit `bit`.
__device__ __forceinline__ void or_bits(uint32_t* words, int64_t bit, uint32_t value) {
  if (value == 0) return;
  const int64_t word = bit >> 5;
  const uint64_t shifted = static_cast<uint64_t>(value) << (bit & 31);
  const uint32_t low = static_cast<uint32_t>(shifted), high = static_cast<uint32_t>(shifted >> 32);
  if (low != 0) atomicOr(words + word, low);
  if (high != 0) atomicOr(words + word + 1, high);
}

// Sets `count` consecutive bits from bit `bit` on.
__device__ __forceinline__ void or_ones(uint32_t* words, int64_t bit, int64_t count) {
  while (count > 0) {
    const int shift = static_cast<int>(bit & 31);
    const int64_t room = 32 - shift;
    const int64_t n = count < room ? count : room;
    const uint32_t mask = (n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1u)) << shift;
    atomicOr(words + (bit >> 5), mask);
    bit += n;
    count -= n;
  }
}

// Byte `i` of a region of `bytes` bytes, 0 past its end.
__device__ __forceinline__ uint32_t region_byte(const uint8_t* region, int64_t bytes, int64_t i) {
  return i < bytes ? static_cast<uint32_t>(region[i]) : 0u;
}

// The 64 bits of a region from bit `bit` on (zeros past its end): at least 57 valid bits
// (chunk_codecs.h peek_bits). Byte loads: the region may start at any byte.
__device__ __forceinline__ uint64_t peek_bits(const uint8_t* region, int64_t bytes, int64_t bit) {
  const int64_t byte = bit >> 3;
  uint64_t word = 0;
#pragma unroll
  for (int b = 0; b < 8; ++b) word |= static_cast<uint64_t>(region_byte(region, bytes, byte + b)) << (8 * b);
  return word >> (bit & 7);
}

// A field of `nbits` <= 32 bits at `bit`.
__device__ __forceinline__ uint32_t read_field(const uint8_t* region, int64_t bytes, int64_t bit, int nbits) {
  return static_cast<uint32_t>(peek_bits(region, bytes, bit) & ((uint64_t{1} << nbits) - 1));
}

// `n` (1, 2 or 4) little-endian bytes at p, which may have any alignment.
__device__ __forceinline__ uint32_t load_le(const uint8_t* p, int n) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  if (n == 4 && (address & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  if (n == 2 && (address & 1) == 0) return *reinterpret_cast<const uint16_t*>(p);
  uint32_t v = 0;
  for (int b = 0; b < n; ++b) v |= static_cast<uint32_t>(p[b]) << (8 * b);
  return v;
}

// ----- block scans (blockDim.x == kThreads; every thread calls, in uniform control flow) ----

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a < b ? b : a;
  }
};
struct MinOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return b < a ? b : a;
  }
};

// Exclusive scan of v over the block in thread order (identity for thread 0); *total gets
// the combination over all threads, in every thread. `warp_totals`: shared, kWarps entries,
// free again when this returns (it ends with a barrier).
template <typename T, typename Op>
__device__ __forceinline__ T block_exclusive_scan(T v, T identity, Op op, T* warp_totals, T* total) {
  const uint32_t lane = lane_id(), warp = warp_id();
  T inclusive = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T y = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= static_cast<uint32_t>(d)) inclusive = op(y, inclusive);
  }
  T in_warp = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) in_warp = identity;
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  T before = identity, all = identity;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const T t = warp_totals[w];
    if (w < static_cast<int>(warp)) before = op(before, t);
    all = op(all, t);
  }
  __syncthreads();
  *total = all;
  return op(before, in_warp);
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T identity, Op op, T* warp_totals) {
  T total;
  block_exclusive_scan(v, identity, op, warp_totals, &total);
  return total;
}

}  // namespace sparsecomm_cuda
