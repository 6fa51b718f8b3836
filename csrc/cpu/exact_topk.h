// Fused error feedback + exact top-k on CPU: what ef_topk_pack and chunk_encode with scale
// groups (compact_encode.cpp) share.
//
// Two strategies, the same result (the selected set is unique: ties go to lower indices):
//
// * sampled (large buckets, density below ~4%): sampled_candidates.h, one streaming
//   pass plus work on ~3k candidates; falls back to the two passes when its bound fails.
// * two passes (always exact, any size and density):
//   pass 1  acc = grad / divisor + residual, written to the residual (or recomputed later
//           when there is none); a per-chunk histogram of the first key digit (12 bits).
//           -> the boundary bin holding the k-th largest magnitude, and for every chunk
//              how many of its entries lie above that bin: their payload offsets.
//   pass 2  entries above the boundary bin go straight to the payload (residual zeroed);
//           boundary-bin entries are collected as candidates (index + value).
//   refine  candidate_select.h finds the exact k-th key among the candidates and emits.
//   Memory traffic: one read of the residual more than the read-read-write floor.
// Either way, a sent entry whose acc is +-Inf or NaN leaves +0 in the residual; unsent ones
// can be non-finite only if all k sent values are, and only then does a cleanup pass zero
// them (csrc/README.md: a non-finite acc is never kept in the residual).
//
// With SentResidual::acc the sent entries keep acc in the residual too (the caller writes
// them): nothing else changes, the cleanup pass included.
//
// Scratch space (histograms, candidates, slabs) lives in per-thread workspaces that only
// ever grow, so the steady state allocates no bucket-sized memory.
#pragma once

#include "sampled_candidates.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {

struct TwoPassWorkspace {
  std::vector<uint32_t> histograms;  // chunk x 2 x 4096 (two interleaved copies, see pass 1)
  std::vector<int64_t> per_chunk;    // chunk x 4096, the two copies summed
  std::vector<int32_t> candidate_index;
  std::vector<float> candidate_value;
};

inline TwoPassWorkspace& two_pass_workspace() {
  static thread_local TwoPassWorkspace ws;
  return ws;
}

constexpr int64_t kTwoPassBlock = 512;  // pass 1 works block-wise: compute (vectorised), then count

// Pass 1 over one chunk: acc written to the residual (when there is one) and its first
// key digit counted. Two histogram copies alternate so that runs of equal digits do not
// serialise on one counter (store-to-load forwarding), which made pass 1 2x slower.
template <typename T>
inline void compensate_and_count(const T* g, T* r, float divisor, bool add_residual, int64_t begin, int64_t end,
                          uint32_t* histogram) {
  uint32_t digits[kTwoPassBlock];
  for (int64_t block = begin; block < end; block += kTwoPassBlock) {
    const int64_t m = std::min(kTwoPassBlock, end - block);
    const T* gb = g + block;
    T* rb = r ? r + block : nullptr;
    if (add_residual) {
      for (int64_t j = 0; j < m; ++j) {
        const T a = compensate<T>(gb[j], divisor, rb + j);
        rb[j] = a;
        digits[j] = magnitude_key(to_float(a)) >> kDigitShift[0];
      }
    } else {
      for (int64_t j = 0; j < m; ++j) {
        const T a = compensate<T>(gb[j], divisor, nullptr);
        if (rb) rb[j] = a;
        digits[j] = magnitude_key(to_float(a)) >> kDigitShift[0];
      }
    }
    int64_t j = 0;
    for (; j + 1 < m; j += 2) {
      ++histogram[digits[j]];
      ++histogram[kDigitBins[0] + digits[j + 1]];
    }
    if (j < m) ++histogram[digits[j]];
  }
}

// Calls visit(i) for every i in [begin, end) whose acc has a key >= bar, in index order.
// acc comes from the residual when pass 1 wrote it there, else it is recomputed from grad.
// At 1% density most 16-element groups hold no such entry: test 16 keys at once.
template <typename T, typename Visit>
inline void for_each_at_or_above(const T* g, const T* r, float divisor, uint32_t bar, int64_t begin, int64_t end,
                          Visit visit) {
  int64_t i = begin;
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
  if constexpr (std::is_same_v<T, float>) {
    const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i nan_key = _mm512_set1_epi32(static_cast<int32_t>(kNanKey));
    const __m512i bar16 = _mm512_set1_epi32(static_cast<int32_t>(bar));
    const __m512 divisor16 = _mm512_set1_ps(divisor);
    for (; i + 16 <= end; i += 16) {
      const __m512 acc = r ? _mm512_loadu_ps(r + i) : _mm512_div_ps(_mm512_loadu_ps(g + i), divisor16);
      const __m512i keys = _mm512_min_epu32(_mm512_and_si512(_mm512_castps_si512(acc), magnitude_mask), nan_key);
      for (__mmask16 hits = _mm512_cmpge_epu32_mask(keys, bar16); hits; hits &= hits - 1) {
        visit(i + __builtin_ctz(hits));
      }
    }
  }
#elif SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
  if constexpr (std::is_same_v<T, float>) {
    const __m256i bar8 = _mm256_set1_epi32(static_cast<int32_t>(bar));
    const __m256 divisor8 = _mm256_set1_ps(divisor);
    for (; i + 8 <= end; i += 8) {
      const __m256 acc = r ? _mm256_loadu_ps(r + i) : _mm256_div_ps(_mm256_loadu_ps(g + i), divisor8);
      for (uint32_t hits = keys_at_or_above(magnitude_keys(acc), bar8); hits; hits &= hits - 1) {
        visit(i + __builtin_ctz(hits));
      }
    }
  }
#endif
  constexpr int64_t kGroup = 16;
  for (; i < end; i += kGroup) {
    const int64_t group_end = std::min(i + kGroup, end);
    uint32_t largest = 0;
    for (int64_t j = i; j < group_end; ++j) {
      const T a = r ? r[j] : compensate<T>(g[j], divisor, nullptr);
      largest = std::max(largest, magnitude_key(to_float(a)));
    }
    if (largest < bar) continue;
    for (int64_t j = i; j < group_end; ++j) {
      const T a = r ? r[j] : compensate<T>(g[j], divisor, nullptr);
      if (magnitude_key(to_float(a)) >= bar) visit(j);
    }
  }
}

// Returns `above`: the payload lists the sure entries in index order, then from `above` on
// the selected candidates in index order.
template <typename T, typename V, SentResidual kSent>
int64_t two_pass_topk_pack(const T* g, T* r, float divisor, bool add_residual, int64_t n, int64_t k,
                           int32_t* out_index, V* out_value, int32_t offset) {
  constexpr bool kRemainder = kSent == SentResidual::remainder;
  const Chunks chunks(n);
  TwoPassWorkspace& ws = two_pass_workspace();
  const uint32_t bins = kDigitBins[0];
  ws.histograms.assign(chunks.count * 2 * bins, 0);

  // Pass 1: compensate (+ write), histogram of the first digit per chunk.
  for_each_chunk(chunks, [&](int64_t c) {
    compensate_and_count<T>(g, r, divisor, add_residual, chunks.begin(c), chunks.end(c),
                            ws.histograms.data() + c * 2 * bins);
  });
  std::vector<int64_t>& per_chunk = ws.per_chunk;
  per_chunk.resize(chunks.count * bins);
  std::vector<int64_t> total(bins, 0);
  for (int64_t c = 0; c < chunks.count; ++c) {
    const uint32_t* pair = ws.histograms.data() + c * 2 * bins;
    for (uint32_t b = 0; b < bins; ++b) {
      per_chunk[c * bins + b] = int64_t{pair[b]} + pair[bins + b];
      total[b] += per_chunk[c * bins + b];
    }
  }
  int64_t above = 0;
  const uint32_t boundary = boundary_bin(total.data(), bins, k, &above);
  const int64_t candidates = total[boundary];

  // Payload offsets of each chunk's sure entries, candidate offsets likewise.
  std::vector<int64_t> sure_offset(chunks.count + 1, 0), candidate_offset(chunks.count + 1, 0);
  for (int64_t c = 0; c < chunks.count; ++c) {
    const int64_t* histogram = per_chunk.data() + c * bins;
    int64_t sure = 0;
    for (uint32_t b = boundary + 1; b < bins; ++b) sure += histogram[b];
    sure_offset[c + 1] = sure_offset[c] + sure;
    candidate_offset[c + 1] = candidate_offset[c] + histogram[boundary];
  }
  TORCH_INTERNAL_ASSERT(sure_offset[chunks.count] == above && candidate_offset[chunks.count] == candidates);
  if (static_cast<int64_t>(ws.candidate_index.size()) < candidates) {
    ws.candidate_index.resize(candidates);
    ws.candidate_value.resize(candidates);
  }
  int32_t* candidate_index = ws.candidate_index.data();
  float* candidate_value = ws.candidate_value.data();
  const uint32_t boundary_key = boundary << kDigitShift[0];  // smallest key in the boundary bin

  // Pass 2: emit the sure entries, collect the candidates.
  for_each_chunk(chunks, [&](int64_t c) {
    int64_t sure = sure_offset[c], candidate = candidate_offset[c];
    int64_t begin = chunks.begin(c);
    const int64_t end = chunks.end(c);
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
    if constexpr (std::is_same_v<T, float> && std::is_same_v<V, float>) {
      // fp32 in, fp32 out (the common case): 16 entries per step, branch-free within a
      // step; sent entries leave +0 in the residual: acc - acc for a finite acc, and the
      // contract's +0 for +-Inf/NaN (where acc - acc would be NaN).
      const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
      const __m512i nan_key = _mm512_set1_epi32(static_cast<int32_t>(kNanKey));
      const __m512i candidate_bar = _mm512_set1_epi32(static_cast<int32_t>(boundary_key));
      const __m512i sure_bar = _mm512_set1_epi32(static_cast<int32_t>(boundary_key + (1u << kDigitShift[0])));
      const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 divisor16 = _mm512_set1_ps(divisor);
      for (; begin + 16 <= end; begin += 16) {
        const __m512 acc = r ? _mm512_loadu_ps(r + begin) : _mm512_div_ps(_mm512_loadu_ps(g + begin), divisor16);
        const __m512i keys = _mm512_min_epu32(_mm512_and_si512(_mm512_castps_si512(acc), magnitude_mask), nan_key);
        const __mmask16 hits = _mm512_cmpge_epu32_mask(keys, candidate_bar);
        if (!hits) continue;
        // boundary == 4095 makes sure_bar wrap to 0x80000000: above every key, as wanted.
        const __mmask16 sent = _mm512_mask_cmpge_epu32_mask(hits, keys, sure_bar);
        const __mmask16 held = hits & ~sent;
        const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(begin)));
        if (sent) {
          _mm512_mask_compressstoreu_epi32(out_index + sure, sent, _mm512_add_epi32(index, _mm512_set1_epi32(offset)));
          _mm512_mask_compressstoreu_ps(out_value + sure, sent, acc);
          if (kRemainder && r) _mm512_mask_storeu_ps(r + begin, sent, _mm512_setzero_ps());
          sure += __builtin_popcount(sent);
        }
        if (held) {
          _mm512_mask_compressstoreu_epi32(candidate_index + candidate, held, index);
          _mm512_mask_compressstoreu_ps(candidate_value + candidate, held, acc);
          candidate += __builtin_popcount(held);
        }
      }
    }
#endif
    for_each_at_or_above<T>(g, r, divisor, boundary_key, begin, end, [&](int64_t i) {
      const float a = to_float(r ? r[i] : compensate<T>(g[i], divisor, nullptr));
      if ((magnitude_key(a) >> kDigitShift[0]) > boundary) {
        const V w = to_wire<T, V>(a);
        out_index[sure] = static_cast<int32_t>(i) + offset;
        out_value[sure] = w;
        ++sure;
        if (kRemainder && r) r[i] = sent_remainder<T, V>(a, w);
      } else {
        candidate_index[candidate] = static_cast<int32_t>(i);
        candidate_value[candidate] = a;
        ++candidate;
      }
    });
    TORCH_INTERNAL_ASSERT(sure == sure_offset[c + 1] && candidate == candidate_offset[c + 1]);
  });

  // The exact k-th key among the boundary-bin candidates, ties to lower indices.
  const std::vector<CandidateList> lists{{candidate_index, candidate_value, candidates}};
  const uint32_t first_digit_mask = (kDigitBins[0] - 1) << kDigitShift[0];
  const Selection selection = select_candidates(lists, k - above, 1, boundary_key, first_digit_mask);
  const int64_t end = emit_selected<T, V>(lists[0], selection, 0, r, out_index, out_value, above, offset,
                                          kRemainder ? Residual::write_sent : Residual::untouched);
  TORCH_INTERNAL_ASSERT(end == k, "exact_topk: emitted ", end, " of k=", k);
  return above;
}

// The whole selection: k entries (index + offset, wire(acc)) into out_index / out_value,
// the residual updated (see SentResidual). Returns m: out[0, m) and out[m, k) are each in
// index order (m == k: all of it).
template <typename T, typename V, SentResidual kSent = SentResidual::remainder>
int64_t exact_topk(const T* g, T* r, float divisor, bool add_residual, int64_t n, int64_t k, int32_t* out_index,
                   V* out_value, int32_t offset) {
  const Sampled sampled =
      sampled_topk_pack<T, V, kSent>(g, r, divisor, add_residual, n, k, out_index, out_value, offset);
  int64_t ascending = k;  // the sampled strategy lists the payload in index order
  // A failed bound left acc in the residual: continue from there (x / 1 is exact, so acc
  // is unchanged). Without a residual, or if the strategy was not tried, start over.
  if (sampled == Sampled::bound_failed && r != nullptr) {
    ascending = two_pass_topk_pack<T, V, kSent>(r, r, 1.0f, false, n, k, out_index, out_value, offset);
  } else if (sampled != Sampled::done) {
    ascending = two_pass_topk_pack<T, V, kSent>(g, r, divisor, add_residual, n, k, out_index, out_value, offset);
  }
  // Sent entries left +0 where acc was not finite; unsent ones hold acc. Non-finite keys
  // rank above every finite one, so an unsent Inf/NaN means that all k sent values are
  // non-finite: only then is the cleanup pass needed (the check stops at the first finite
  // value). Every sent entry then holds +0 (or, with SentResidual::acc, its non-finite acc,
  // which must become +0 as well), so none needs skipping.
  if (r != nullptr && all_non_finite(out_value, k)) {
    const Chunks chunks(n);
    for_each_chunk(chunks, [&](int64_t c) {
      zero_unsent_non_finite<T>(r, chunks.begin(c), chunks.end(c), nullptr, 0);
    });
  }
  return ascending;
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
