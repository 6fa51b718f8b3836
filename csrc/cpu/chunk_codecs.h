// Shared by chunk_encode.cpp and chunk_decode_add.cpp: the index and value codecs of a
// chunked payload, one entry or one chunk at a time, bit for bit as
// sparsecomm/compress/index_codecs.py, value_codecs.py and bitpack.py write them.
#pragma once

#include "magnitude_key.h"
#include "chunk_format.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {

inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// ----- bit streams: fields LSB first, bit i in bit i % 8 of byte i / 8 ------------------

// Appends fields to a region from a byte-aligned start. Every byte it covers is written
// (the unused high bits of the last byte as zeros), none outside, so writers that start
// on different bytes can run in parallel.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  // bits <= 32; value < 2^bits.
  void put(uint64_t value, int bits) {
    buffer_ |= value << filled_;
    filled_ += bits;
    if (filled_ >= 32) {
      const uint32_t word = static_cast<uint32_t>(buffer_);
      std::memcpy(out_, &word, 4);
      out_ += 4;
      buffer_ >>= 32;
      filled_ -= 32;
    }
  }
  void put_ones(int64_t count) {
    for (; count >= 32; count -= 32) put(0xFFFFFFFFu, 32);
    if (count) put((uint64_t{1} << count) - 1, static_cast<int>(count));
  }
  void put_zeros(int64_t count) {
    for (; count >= 32; count -= 32) put(0, 32);
    if (count) put(0, static_cast<int>(count));
  }
  // Writes the partial last bytes.
  void finish() {
    for (; filled_ > 0; filled_ -= 8) {
      *out_++ = static_cast<uint8_t>(buffer_);
      buffer_ >>= 8;
    }
    filled_ = 0;
  }

 private:
  uint8_t* out_;
  uint64_t buffer_ = 0;
  int filled_ = 0;
};

// The 64 bits of a region from bit `bit` on (zeros past its end).
inline uint64_t peek_bits(const uint8_t* region, int64_t region_bytes, int64_t bit) {
  const int64_t byte = bit >> 3;
  uint64_t word = 0;
  if (byte + 8 <= region_bytes) {
    std::memcpy(&word, region + byte, 8);
  } else if (byte < region_bytes) {
    std::memcpy(&word, region + byte, region_bytes - byte);
  }
  return word >> (bit & 7);  // at least 57 valid bits
}

// A field of `bits` <= 32 bits at `bit`.
inline uint32_t read_field(const uint8_t* region, int64_t region_bytes, int64_t bit, int bits) {
  return static_cast<uint32_t>(peek_bits(region, region_bytes, bit) & ((uint64_t{1} << bits) - 1));
}

// ----- value codecs ------------------------------------------------------------------------

// bfloat16 rounding of a float32 >= 0, finite, in a stated direction (bit operations).
inline float bf16_round_up(float x) { return bits_float((float_bits(x) + 0xFFFFu) & ~0xFFFFu); }
inline float bf16_round_down(float x) { return bits_float(float_bits(x) & ~0xFFFFu); }

inline int32_t int_codec_qmax(int32_t codec) {
  return codec == kValueInt8 ? 127 : codec == kValueInt4 ? 7 : 1;
}

// The chunk's scale from its selected values (value_codecs.chunk_scales): NaN if one is
// NaN, else +Inf if one is +-Inf, else from the largest (and, for sign, the smallest
// non-zero) magnitude, rounded to bfloat16 in the codec's direction. Worked out on
// magnitude keys (NaN above Inf above every finite value): integer maxima, no branch per
// entry.
inline float chunk_scale(int32_t codec, const float* v, int64_t count) {
  uint32_t largest = 0, smallest = 0xFFFFFFFFu;  // keys; smallest: of the non-zero ones
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t key = magnitude_key(v[j]), non_zero = key == 0 ? 0xFFFFFFFFu : key;
    largest = largest > key ? largest : key;
    smallest = smallest < non_zero ? smallest : non_zero;
  }
  if (largest == kNanKey) return bits_float(0x7FC00000u);
  if (largest == kInfKey) return std::numeric_limits<float>::infinity();
  const float top = key_as_float(largest);  // every magnitude is finite from here on
  switch (codec) {
    case kValueFp8:
      return bf16_round_up(top / 448.0f);
    case kValueInt8:
      return bf16_round_up(top * 0.0078125f);  // 2^-7: exact
    case kValueInt4:
      return bf16_round_up(top * 0.125f);
    case kValueInt2:
      return bf16_round_up(top * 0.5f);
    default: {  // sign
      const float bottom = smallest == 0xFFFFFFFFu ? 0.0f : key_as_float(smallest);
      const float scale = bf16_round_down(std::min(2.0f * bottom, bottom / 2.0f + top / 2.0f));
      return std::max(scale, bf16_round_up(top * 1.52587890625e-05f));  // 2^-16
    }
  }
}

// std::nearbyint under the default rounding mode (to nearest, ties to even) in plain
// arithmetic, which vectorises at every level (the baseline has no rounding instruction):
// from 2^23 on a float's ulp is 1, so |x| + 2^23 rounds |x| to an integer, and a float of
// that size (or Inf, or NaN) is one already.
inline float round_to_integer(float x) {
  const float magnitude = std::fabs(x);
  const float rounded = std::copysign((magnitude + 8388608.0f) - 8388608.0f, x);
  return magnitude < 8388608.0f ? rounded : x;
}

// The code of value v in a chunk of scale s (value_codecs._codes).
inline uint32_t value_code(int32_t codec, float v, float s) {
  const bool negative = std::signbit(v) && !std::isnan(v);
  if (codec == kValueSign) return negative ? 1u : 0u;
  const bool finite_scale = std::isfinite(s);
  if (codec == kValueFp8) {
    float ratio = s > 0.0f ? v / s : 0.0f;
    ratio = ratio < -448.0f ? -448.0f : (ratio > 448.0f ? 448.0f : ratio);
    if (!finite_scale) ratio = negative ? -448.0f : 448.0f;
    return c10::Float8_e4m3fn(ratio).x;
  }
  const int32_t qmax = int_codec_qmax(codec);
  const float limit = static_cast<float>(qmax);
  float q = s > 0.0f ? round_to_integer(v / s) : 0.0f;
  q = std::min(std::max(q, -limit), limit);  // min/max instructions, not branches (q is not NaN where it counts)
  if (!finite_scale) q = negative ? -limit : limit;
  return static_cast<uint32_t>(static_cast<int32_t>(q) + qmax);
}

// What a receiver adds for a code of a scaled codec (value_codecs.decode).
inline float decode_code(int32_t codec, uint32_t code, float s) {
  float level;
  if (codec == kValueSign) {
    level = 1.0f - 2.0f * static_cast<float>(code);
  } else if (codec == kValueFp8) {
    level = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
  } else {
    level = static_cast<float>(static_cast<int32_t>(code) - int_codec_qmax(codec));
  }
  // x86's rule for a NaN operand (the result is that NaN), written out: knowing that level
  // is +-1, the compiler may turn the product into a sign flip, which flips a NaN's sign.
  if (std::isnan(level)) return level;
  if (std::isnan(s)) return s;
  return level * s;
}

// Float codecs: the wire bits of a float32 acc v (to_wire: finite values beyond the
// dtype's range saturate), and the value they stand for.
inline uint32_t float_wire_bits(int32_t codec, float v) {
  if (codec == kValueFp32) return float_bits(v);
  if (codec == kValueBf16) {
    if (std::isnan(v)) return 0xFFFFu;  // the NaN torch's float->bfloat16 conversion writes
    return to_wire<float, c10::BFloat16>(v).x;
  }
  return to_wire<float, c10::Half>(v).x;
}

inline float float_wire_value(int32_t codec, uint32_t bits) {
  if (codec == kValueFp32) return bits_float(bits);
  if (codec == kValueBf16) return bits_float(bits << 16);
  return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
}

// What a decoder adds: dst[i] = T(float(dst[i]) + float(T(value))), bitwise one index_add_.
template <typename T>
inline void add_to(T* dst, int64_t i, float value) {
  dst[i] = static_cast<T>(to_float(dst[i]) + to_float(static_cast<T>(value)));
}

inline float scale_from_bytes(const uint8_t* scales, int64_t chunk) {
  uint16_t bits;
  std::memcpy(&bits, scales + 2 * chunk, 2);
  return bits_float(uint32_t{bits} << 16);
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
