// A threshold for "about k entries" with a bounded count error, on CPU.
//
// Radix select over the magnitude key, one read-only pass per digit (12 + 12 + 7 bits),
// stopping as soon as a bin edge gives a count within max_relative_error * k. A 12-bit
// bin of smooth data holds a few tenths of a percent of the entries, so a 5% bound at 1%
// density usually needs two passes. Only equal magnitudes straddling the k-th entry can
// defeat the bound.
#include "sampled_candidates.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

Slabs& estimate_slabs() {
  static thread_local Slabs slabs;
  return slabs;
}

// Large inputs at low density: one read pass collecting the entries at or above a sampled
// bound (sampled_candidates.h), then the exact k-th key among them. False if the bound
// failed or the input is too small or too dense for it; the histogram passes then run.
template <typename T>
bool sampled_threshold(const T* x, int64_t n, int64_t k, double tolerance, std::pair<uint32_t, int64_t>* best) {
  uint32_t bound = 0;
  int64_t expected = 0;
  if (!sample_bound<T>(x, nullptr, 1.0f, false, n, k, &bound, &expected)) return false;
  const int64_t capacity = expected + expected / 4 + 4096;
  // x / 1 is exact: acc == x; without a residual nothing is written back.
  const Collected c = collect_in_ranges<T, T>(x, nullptr, 1.0f, false, bound, n, capacity, estimate_slabs());
  if (c.overflow || c.total < k) return false;
  const std::vector<CandidateList>& lists = c.lists;
  const Selection s = select_candidates(lists, k, 0, 0, 0);
  int64_t above = 0;  // keys above the k-th key's prefix: every one of them is a candidate
  for (int64_t a : s.take_above) above += a;
  *best = {s.prefix, above + s.matching};  // the prefix's lowest key: count >= k
  const bool ties_break_the_bound = static_cast<double>(best->second - k) > tolerance;
  if (ties_break_the_bound && above > 0 && k - above < best->second - k) {
    *best = {s.prefix + 1, above};  // (a full key here: the prefix was resolved to 31 bits)
  }
  return true;
}

template <typename T>
std::pair<uint32_t, int64_t> topk_threshold_impl(const at::Tensor& x, int64_t k, double max_relative_error) {
  const int64_t n = x.numel();
  const T* data = x.const_data_ptr<T>();
  const Chunks chunks(n);
  const double tolerance = max_relative_error * static_cast<double>(k);
  int64_t above = 0;  // entries whose key is above the current prefix's range
  uint32_t prefix = 0, prefix_mask = 0;
  std::pair<uint32_t, int64_t> best{0, n};  // threshold key 0 selects everything
  for (int level = 0; level < 3; ++level) {
    const uint32_t bins = kDigitBins[level];
    std::vector<int64_t> per_chunk(chunks.count * bins, 0);
    for_each_chunk(chunks, [&](int64_t c) {
      int64_t* histogram = per_chunk.data() + c * bins;
      const int64_t end = chunks.end(c);
      for (int64_t i = chunks.begin(c); i < end; ++i) {
        const uint32_t key = magnitude_key(to_float(data[i]));
        if ((key & prefix_mask) == prefix) ++histogram[digit(key, level)];
      }
    });
    std::vector<int64_t> histogram(bins, 0);
    for (int64_t c = 0; c < chunks.count; ++c)
      for (uint32_t b = 0; b < bins; ++b) histogram[b] += per_chunk[c * bins + b];
    int64_t higher = 0;
    const uint32_t bin = boundary_bin(histogram.data(), bins, k - above, &higher);
    const uint32_t low_edge = prefix | (bin << kDigitShift[level]);
    // Two candidate thresholds: the boundary bin's lower edge (count >= k) and its upper
    // edge (count < k; only if some entry lies above it: selecting nothing is no answer).
    const int64_t with_bin = above + higher + histogram[bin];
    if (std::llabs(with_bin - k) < std::llabs(best.second - k)) best = {low_edge, with_bin};
    const uint64_t high_edge = static_cast<uint64_t>(low_edge) + (1ull << kDigitShift[level]);
    if (high_edge <= 0x7FFFFFFFull && above + higher > 0 && std::llabs(above + higher - k) < std::llabs(best.second - k)) {
      best = {static_cast<uint32_t>(high_edge), above + higher};
    }
    if (std::llabs(best.second - k) <= tolerance) break;
    above += higher;
    prefix = low_edge;
    prefix_mask |= (bins - 1) << kDigitShift[level];
  }
  return best;
}

}  // namespace

// Arguments checked by the caller (dispatch/cpu_ops.cpp).
std::pair<uint32_t, int64_t> topk_threshold(const at::Tensor& x, int64_t k, double max_relative_error) {
  return SPARSECOMM_DISPATCH_FLOATING(x.scalar_type(), "topk_threshold", T, [&] {
    std::pair<uint32_t, int64_t> best;
    if (!sampled_threshold<T>(x.const_data_ptr<T>(), x.numel(), k, max_relative_error * static_cast<double>(k),
                              &best)) {
      best = topk_threshold_impl<T>(x, k, max_relative_error);
    }
    return best;
  });
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
