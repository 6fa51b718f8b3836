// Exact selection among candidate lists, and emitting the selected entries.
//
// Both strategies of ef_topk_pack end with a few lists of candidates (index + acc value,
// each list in index order) that all share a known key prefix, and a number `need` of
// them to take. Radix digits of the key (12 + 12 + 7 bits, histograms per list) narrow
// the prefix down to the k-th key; entries above it are taken, and of those equal to it
// the lowest indices. Candidates are a few percent of the bucket at most, so these scans
// are cheap next to the passes over the bucket.
#pragma once

#include "magnitude_key.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {

struct CandidateList {
  const int32_t* index;  // bucket-relative, ascending
  const float* value;    // acc, exactly (every T converts to float without rounding)
  int64_t size;
};

// What to take: every entry whose key, masked, is above `prefix`; of those equal to it,
// the first take_equal[l] of list l. take_above[l] counts the former, per list.
struct Selection {
  uint32_t prefix = 0;
  uint32_t mask = 0;
  std::vector<int64_t> take_above, take_equal;
  int64_t matching = 0;  // entries whose masked key equals the prefix (all lists)
  int64_t taken(size_t list) const { return take_above[list] + take_equal[list]; }
};

// `need` of the candidates, all of which match (prefix, mask) and whose digits of the
// levels before `first_level` are already fixed by it.
inline Selection select_candidates(const std::vector<CandidateList>& lists, int64_t need, int first_level,
                                   uint32_t prefix, uint32_t mask) {
  const int64_t count = static_cast<int64_t>(lists.size());
  Selection s;
  s.prefix = prefix;
  s.mask = mask;
  s.take_above.assign(count, 0);
  s.take_equal.assign(count, 0);
  std::vector<int64_t> matching(count);
  for (int64_t l = 0; l < count; ++l) matching[l] = lists[l].size;
  for (int level = first_level; level < 3; ++level) {
    int64_t total_matching = 0;
    for (int64_t m : matching) total_matching += m;
    if (need == total_matching) break;  // every entry with this prefix is taken
    const uint32_t bins = kDigitBins[level];
    std::vector<int64_t> histograms(count * bins, 0);
    at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
      for (int64_t l = first; l < last; ++l) {
        int64_t* histogram = histograms.data() + l * bins;
        for (int64_t j = 0; j < lists[l].size; ++j) {
          const uint32_t key = magnitude_key(lists[l].value[j]);
          if ((key & s.mask) == s.prefix) ++histogram[digit(key, level)];
        }
      }
    });
    std::vector<int64_t> total(bins, 0);
    for (int64_t l = 0; l < count; ++l)
      for (uint32_t b = 0; b < bins; ++b) total[b] += histograms[l * bins + b];
    int64_t higher = 0;
    const uint32_t bin = boundary_bin(total.data(), bins, need, &higher);
    need -= higher;
    for (int64_t l = 0; l < count; ++l) {
      const int64_t* histogram = histograms.data() + l * bins;
      for (uint32_t b = bin + 1; b < bins; ++b) s.take_above[l] += histogram[b];
      matching[l] = histogram[bin];
    }
    s.prefix |= bin << kDigitShift[level];
    s.mask |= (bins - 1) << kDigitShift[level];
  }
  for (int64_t l = 0; l < count; ++l) {  // ties at the k-th key: lowest indices first
    s.matching += matching[l];
    s.take_equal[l] = std::min(matching[l], need);
    need -= s.take_equal[l];
  }
  TORCH_INTERNAL_ASSERT(need == 0, "select_candidates: ", need, " entries short");
  return s;
}

// What a selection leaves in the residual at the entries it sends (every other entry gets acc):
// `remainder`, acc - wire(acc) (ef_topk_pack, ef_threshold_pack: the residual is final);
// `acc`, acc itself, for a caller that writes the sent entries' residual afterwards
// (chunk_encode with scale groups: acc - decoded needs the scales of the whole payload).
// Keeping acc also saves the write-back of the candidates that were not sent.
enum class SentResidual { remainder, acc };

// How emit_selected updates the residual (when there is one).
enum class Residual {
  write_sent,      // it holds acc everywhere: leave acc - sent at the sent entries
  restore_unsent,  // candidates already hold acc - sent: put acc back where not sent
  untouched,       // it holds acc everywhere and keeps it (SentResidual::acc)
};

// Writes list l's selected entries to the payload from `position` on and updates the
// residual so that it holds acc - sent. Returns the next position.
template <typename T, typename V>
int64_t emit_selected(const CandidateList& list, const Selection& s, size_t l, T* residual, int32_t* out_index,
                      V* out_value, int64_t position, int32_t index_offset, Residual mode) {
  constexpr int64_t kPrefetchDistance = 32;  // residual writes are scattered: overlap the misses
  int64_t equal_left = s.take_equal[l];
  for (int64_t j = 0; j < list.size; ++j) {
    if (residual && mode != Residual::untouched && j + kPrefetchDistance < list.size) {
      __builtin_prefetch(residual + list.index[j + kPrefetchDistance], 1);
    }
    const float a = list.value[j];
    const uint32_t masked = magnitude_key(a) & s.mask;
    if (!(masked > s.prefix || (masked == s.prefix && equal_left-- > 0))) {
      if (residual && mode == Residual::restore_unsent) residual[list.index[j]] = static_cast<T>(a);
      continue;
    }
    const V w = to_wire<T, V>(a);
    out_index[position] = list.index[j] + index_offset;
    out_value[position] = w;
    ++position;
    if (residual && mode == Residual::write_sent) residual[list.index[j]] = sent_remainder<T, V>(a, w);
  }
  return position;
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
