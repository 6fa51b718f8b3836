// Shared pieces of the CPU kernels: magnitude keys, radix digits, the error-feedback
// arithmetic of csrc/README.md, and a fixed chunking of the input.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace sparsecomm {

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

// Value on the wire: a narrower dtype saturates finite values at its largest finite
// value (the excess stays in the residual) instead of turning them into Inf.
template <typename V>
inline V to_wire(float a) {
  const float limit = static_cast<float>(std::numeric_limits<V>::max());
  if (std::isfinite(a) && std::fabs(a) > limit) a = std::copysign(limit, a);
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

// Checks shared by the pack operators (see csrc/README.md, "Errors").
inline void check_pack_arguments(const char* op, const at::Tensor& grad, const c10::optional<at::Tensor>& residual,
                                 bool add_residual, const at::Tensor& indices_out, const at::Tensor& values_out) {
  TORCH_CHECK(grad.dim() == 1 && grad.is_contiguous(), op, ": grad must be a contiguous 1-D tensor");
  TORCH_CHECK(grad.numel() <= std::numeric_limits<int32_t>::max(), op,
              ": grad has ", grad.numel(), " elements; int32 indices allow at most 2^31 - 1");
  TORCH_CHECK(indices_out.dim() == 1 && indices_out.is_contiguous() && indices_out.scalar_type() == at::kInt, op,
              ": indices_out must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(values_out.dim() == 1 && values_out.is_contiguous(), op, ": values_out must be a contiguous 1-D tensor");
  TORCH_CHECK(values_out.numel() >= indices_out.numel(), op, ": values_out holds ", values_out.numel(),
              " entries, indices_out ", indices_out.numel());
  TORCH_CHECK(!add_residual || residual.has_value(), op, ": add_residual=True needs a residual");
  for (const at::Tensor* t : {&indices_out, &values_out}) {
    TORCH_CHECK(t->device() == grad.device(), op, ": outputs must be on grad's device ", grad.device());
  }
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.dim() == 1 && r.is_contiguous() && r.numel() == grad.numel() && r.scalar_type() == grad.scalar_type(),
                op, ": residual must be a contiguous 1-D tensor matching grad (", grad.numel(), " x ",
                grad.scalar_type(), ")");
    TORCH_CHECK(r.device() == grad.device(), op, ": residual must be on grad's device ", grad.device());
    TORCH_CHECK(r.data_ptr() != grad.data_ptr(), op, ": residual may not alias grad");
  }
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

}  // namespace sparsecomm
