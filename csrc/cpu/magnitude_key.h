// Shared pieces of the CPU kernels: magnitude keys (8 at a time at the AVX2 level), radix
// digits, the error-feedback arithmetic of csrc/README.md, and a fixed chunking of the input.
#pragma once

#include "dependencies.h"

#ifndef SPARSECOMM_CPU_NAMESPACE
#error "kernel code is compiled once per CPU level, through isa/compile_level.h"
#endif

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {

// Ranks entries by magnitude: the bits of float32(|x|). Monotone for finite values,
// +-Inf above every finite value, NaN above Inf, so non-finite values are selected first
// (and sent unchanged, so every rank sees the overflow; they leave +0 in the residual, see
// sent_remainder and zero_unsent_non_finite). Every NaN gets the same key (NaN payload
// bits differ between conversion paths and devices), so among NaNs, as among other equal
// keys, the lower index wins.
constexpr uint32_t kNanKey = 0x7F800001u;
constexpr uint32_t kInfKey = 0x7F800000u;  // keys >= this one: +-Inf and NaN
inline uint32_t magnitude_key(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return std::min(bits & 0x7FFFFFFFu, kNanKey);
}

inline float key_as_float(uint32_t key) {
  float x;
  std::memcpy(&x, &key, sizeof(x));
  return x;
}

#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
// magnitude_key of 8 floats at once.
inline __m256i magnitude_keys(__m256 x) {
  const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
  return _mm256_min_epu32(magnitude, _mm256_set1_epi32(static_cast<int32_t>(kNanKey)));
}

// Bit j set where keys[j] >= bar[j] as unsigned numbers (AVX2 compares signed only):
// where max(key, bar) == key.
inline uint32_t keys_at_or_above(__m256i keys, __m256i bar) {
  const __m256i at_or_above = _mm256_cmpeq_epi32(_mm256_max_epu32(keys, bar), keys);
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(at_or_above)));
}

inline uint32_t max_lane(__m256i keys) {
  const __m128i half = _mm_max_epu32(_mm256_castsi256_si128(keys), _mm256_extracti128_si256(keys, 1));
  const __m128i quarter = _mm_max_epu32(half, _mm_shuffle_epi32(half, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m128i eighth = _mm_max_epu32(quarter, _mm_shuffle_epi32(quarter, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(eighth));
}
#endif

// The 31 key bits as three radix digits, most significant first: 12 + 12 + 7 bits.
// 12-bit histograms (4096 x 4 bytes) stay in L1 while the data streams past.
constexpr int kDigitShift[3] = {19, 7, 0};
constexpr uint32_t kDigitBins[3] = {4096, 4096, 128};
inline uint32_t digit(uint32_t key, int level) {
  return (key >> kDigitShift[level]) & (kDigitBins[level] - 1);
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// acc = T(float(grad) / divisor), then T(float(acc) + float(residual)): the same two
// roundings as the hook's grad.div_(world_size).add_(residual).
template <typename T>
inline T compensate(T grad, float divisor, const T* residual) {
  T acc = static_cast<T>(to_float(grad) / divisor);
  return residual ? static_cast<T>(to_float(acc) + to_float(*residual)) : acc;
}

// Value on the wire of acc `a` (of dtype T): a narrower dtype V saturates finite values
// instead of turning them into Inf, and the excess stays in the residual. A value beyond
// V's largest, L, goes out as +-s: L rounded down to a multiple of a's ulp in T, so that s
// and a - s are multiples of that ulp below |a|, both exact in T (sent + residual == acc).
// L itself would not do: fp16's 65504 is 2047 x 32, and float32 from 2^29 on has an ulp of
// 64 or more. s is 0 once the ulp exceeds L (fp16: float32 from 2^39, bf16 from 2^23 on).
template <typename T, typename V>
inline V to_wire(float a) {
  const float limit = static_cast<float>(std::numeric_limits<V>::max());
  if (std::isfinite(a) && std::fabs(a) > limit) {
    // 2^exponent (a's key with the mantissa cleared; a is normal), over 2^(T's mantissa bits)
    constexpr float kUlpPerUnit = 1.0f / static_cast<float>(1 << (std::numeric_limits<T>::digits - 1));
    const float ulp = key_as_float(magnitude_key(a) & kInfKey) * kUlpPerUnit;
    a = std::copysign(std::floor(limit / ulp) * ulp, a);
  }
  return static_cast<V>(a);
}

// What stays behind of a sent entry: acc - T(wire(acc)), exact in T for same-width wires;
// +0 for a non-finite acc, where that would be Inf - Inf = NaN: kept, it would rank first
// and be sent again on every later step.
template <typename T, typename V>
inline T sent_remainder(float acc, V wire) {
  if (!std::isfinite(acc)) return static_cast<T>(0.0f);
  return static_cast<T>(acc - to_float(static_cast<T>(to_float(wire))));
}

// Whether all sent values are +-Inf or NaN (wire() keeps finite values finite and
// non-finite ones non-finite, so: whether every sent acc is non-finite); stops at the first
// finite one (usually the first), so it costs nothing on an ordinary step.
template <typename V>
inline bool all_non_finite(const V* values, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    if (std::isfinite(to_float(values[j]))) return false;
  }
  return true;
}

// The cleanup pass of the rare step that leaves non-finite entries unsent: over [begin,
// end) of a residual that holds acc at every entry not sent, +0 replaces +-Inf and NaN.
// The sent entries (`sent`, ascending, within the range) are skipped: they already hold
// their remainder, which is non-finite for a finite acc in one case (fp16 grad, bf16 wire:
// bf16 rounds values near 65504 up to 65536) and must stay as it is, as in the reference.
// The residual doubles as the storage of acc while the kernels select, so they cannot zero
// on the way; they run this only when the step can have left an unsent Inf/NaN (see
// ef_topk_pack.cpp and ef_threshold_pack.cpp), never on an all-finite step.
template <typename T>
inline void zero_unsent_non_finite(T* r, int64_t begin, int64_t end, const int32_t* sent, int64_t sent_count) {
  int64_t s = 0;
  for (int64_t i = begin; i < end; ++i) {
    if (s < sent_count && sent[s] == i) {
      ++s;
      continue;
    }
    if (!std::isfinite(to_float(r[i]))) r[i] = static_cast<T>(0.0f);
  }
}

// Chunks depend only on n, never on the thread count, so per-chunk counts, payload
// order and results are the same with 1 or 64 threads.
struct Chunks {
  static constexpr int64_t kMinElements = 1 << 16;
  static constexpr int64_t kMax = 64;
  int64_t n;
  int64_t count;
  explicit Chunks(int64_t n_)
      : n(n_), count(std::clamp<int64_t>((n_ + kMinElements - 1) / kMinElements, 1, kMax)) {}
  int64_t begin(int64_t c) const { return n * c / count; }
  int64_t end(int64_t c) const { return n * (c + 1) / count; }
};

// Runs fn(chunk) for every chunk, in parallel over torch's intra-op threads.
template <typename Fn>
inline void for_each_chunk(const Chunks& chunks, Fn fn) {
  at::parallel_for(0, chunks.count, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) fn(c);
  });
}

// Walks a histogram from the top bin down and returns the bin holding the `need`-th
// largest entry; `above` receives how many entries lie in higher bins.
inline uint32_t boundary_bin(const int64_t* histogram, uint32_t bins, int64_t need, int64_t* above) {
  int64_t seen = 0;
  for (uint32_t b = bins; b-- > 0;) {
    if (seen + histogram[b] >= need) {
      *above = seen;
      return b;
    }
    seen += histogram[b];
  }
  TORCH_INTERNAL_ASSERT(false, "boundary_bin: histogram holds fewer than ", need, " entries");
}

// grad dtype T x wire dtype V, each fp32, bf16 or fp16.
#define SPARSECOMM_DISPATCH_FLOATING(TYPE, NAME, ALIAS, ...)                                   \
  [&] {                                                                                        \
    switch (TYPE) {                                                                            \
      case at::kFloat: { using ALIAS = float; return __VA_ARGS__(); }                          \
      case at::kBFloat16: { using ALIAS = c10::BFloat16; return __VA_ARGS__(); }              \
      case at::kHalf: { using ALIAS = c10::Half; return __VA_ARGS__(); }                      \
      default: TORCH_CHECK(false, NAME, ": dtype must be float32, bfloat16 or float16, got ", TYPE); \
    }                                                                                          \
  }()

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
