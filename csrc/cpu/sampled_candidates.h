// The one-pass strategy of ef_topk_pack for large buckets at low density.
//
// A sample of acc (2,048 evenly spaced runs of 32 entries: cheap to read, unlike 65,536
// scattered entries) gives a key bound L that about 1.5k entries reach (1.5x margin +
// 50 sample hits). One streaming pass then computes acc and appends every entry with key
// >= L to its range's slab, writing to the residual acc for the others and, tentatively,
// the "sent" remainder for these. Exact top-k among the slabs (candidate_select.h)
// follows; only the ~0.5k candidates not sent get their acc written back. Memory traffic:
// read grad + residual, write residual, plus ~1.5% of the bucket in slabs: about the
// read-read-write floor.
//
// The bound is a guess, so the pass verifies it: if fewer than k entries reach L (the
// sample over-estimated) or a slab overflows (it under-estimated), the caller falls back
// to the two-pass histogram strategy, which is always exact. With random data either
// failure needs the sample count to be off by ~1.5x in ~1000 hits; adversarial layouts
// (large values only at sampled positions) only cost speed.
#pragma once

#include "candidate_select.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {

constexpr int64_t kSampledMinElements = 1 << 20;  // below this the two passes are cheap anyway
constexpr int64_t kSampleRuns = 2048, kSampleRun = 32, kSamples = kSampleRuns * kSampleRun;

struct Slabs {
  std::vector<uint32_t> sample_keys;
  std::vector<int32_t> index;
  std::vector<float> value;
};

inline Slabs& sampled_slabs() {
  static thread_local Slabs slabs;  // grows to the largest bucket seen, then reused
  return slabs;
}

// Key bound L and the expected number of entries reaching it; false if the density is
// too high for a bound to pay off.
template <typename T>
bool sample_bound(const T* g, const T* r, float divisor, bool add_residual, int64_t n, int64_t k, uint32_t* bound,
                  int64_t* expected) {
  const int64_t hits = static_cast<int64_t>(1.5 * static_cast<double>(k) * kSamples / static_cast<double>(n)) + 50;
  if (n < kSampledMinElements || hits >= kSamples / 8) return false;
  std::vector<uint32_t>& keys = sampled_slabs().sample_keys;
  keys.resize(kSamples);
  at::parallel_for(0, kSampleRuns, 64, [&](int64_t first, int64_t last) {
    for (int64_t run = first; run < last; ++run) {
      const int64_t start = run * (n - kSampleRun) / (kSampleRuns - 1);
      for (int64_t j = 0; j < kSampleRun; ++j) {
        const int64_t i = start + j;
        keys[run * kSampleRun + j] =
            magnitude_key(to_float(compensate<T>(g[i], divisor, add_residual ? r + i : nullptr)));
      }
    }
  });
  std::nth_element(keys.begin(), keys.begin() + (hits - 1), keys.end(), std::greater<uint32_t>());
  *bound = keys[hits - 1];
  *expected = hits * n / kSamples;
  return true;
}

// The vector paths without compress instructions append their (few) hits one by one:
// lane j of `lane` is entry first + j, `hits` a bit per lane. Each sent entry leaves +0
// in the residual (kSent == remainder). Returns the new count (stored while < capacity).
template <SentResidual kSent>
inline int64_t append_hits(const float* lane, uint32_t hits, int64_t first, float* r, int32_t* slab_index,
                           float* slab_value, int64_t capacity, int64_t count) {
  for (; hits; hits &= hits - 1) {
    const int j = __builtin_ctz(hits);
    if (count < capacity) {
      slab_index[count] = static_cast<int32_t>(first + j);
      slab_value[count] = lane[j];
      if (kSent == SentResidual::remainder && r) r[first + j] = 0.0f;
    }
    ++count;
  }
  return count;
}

// The streaming pass over [begin, end): entries with key >= bound go into the slab
// (index, acc), in index order, while it has room, and leave the remainder of sending
// them in the residual (kSent == remainder; acc with SentResidual::acc); all other entries
// (also those that found the slab full) leave acc. Returns how many entries reached the bound (stored: the first min(that, capacity));
// *largest_key receives the largest key in the range, reaching the bound or not: >= kInfKey
// if some acc there is +-Inf or NaN (ef_threshold_pack's cue for its cleanup pass; a max
// costs one instruction per 16 entries, a count of them measurably more).
template <typename T, typename V, SentResidual kSent = SentResidual::remainder>
int64_t collect_candidates(const T* g, T* r, float divisor, bool add_residual, uint32_t bound, int64_t begin,
                           int64_t end, int32_t* slab_index, float* slab_value, int64_t capacity,
                           uint32_t* largest_key) {
  int64_t count = 0;
  uint32_t largest = 0;
  int64_t i = begin;
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
  if constexpr (std::is_same_v<T, float> && std::is_same_v<V, float>) {
    const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i nan_key = _mm512_set1_epi32(static_cast<int32_t>(kNanKey));
    const __m512i bound16 = _mm512_set1_epi32(static_cast<int32_t>(bound));
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 divisor16 = _mm512_set1_ps(divisor);
    __m512i largest16 = _mm512_setzero_si512();
    for (; i + 16 <= end; i += 16) {
      __m512 acc = _mm512_div_ps(_mm512_loadu_ps(g + i), divisor16);  // same roundings as compensate()
      if (add_residual) acc = _mm512_add_ps(acc, _mm512_loadu_ps(r + i));
      const __m512i keys = _mm512_min_epu32(_mm512_and_si512(_mm512_castps_si512(acc), magnitude_mask), nan_key);
      const __mmask16 hits = _mm512_cmpge_epu32_mask(keys, bound16);
      largest16 = _mm512_max_epu32(largest16, keys);
      const int64_t found = __builtin_popcount(hits);
      const int64_t stored = std::clamp<int64_t>(capacity - count, 0, found);
      // The lowest `stored` lanes of hits: those that get a slab entry.
      const __mmask16 kept = static_cast<__mmask16>(_pdep_u32((1u << stored) - 1, hits));
      // Sending acc exactly leaves +0 behind: acc - acc for a finite acc, and the
      // contract's +0 for +-Inf/NaN (where acc - acc would be NaN).
      if (r) {
        if constexpr (kSent == SentResidual::remainder) {
          _mm512_storeu_ps(r + i, _mm512_mask_mov_ps(acc, kept, _mm512_setzero_ps()));
        } else {
          _mm512_storeu_ps(r + i, acc);
        }
      }
      if (stored > 0) {  // compress into a register, then a plain masked store
        const __mmask16 first = static_cast<__mmask16>((1u << stored) - 1);
        const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(i)));
        _mm512_mask_storeu_epi32(slab_index + count, first, _mm512_maskz_compress_epi32(hits, index));
        _mm512_mask_storeu_ps(slab_value + count, first, _mm512_maskz_compress_ps(hits, acc));
      }
      count += found;
    }
    largest = _mm512_reduce_max_epu32(largest16);
  }
#elif SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
  if constexpr (std::is_same_v<T, float> && std::is_same_v<V, float>) {
    // 8 entries per step. Without compress instructions the (few) hits are appended one by
    // one; each sent one leaves +0, as above.
    const __m256i bound8 = _mm256_set1_epi32(static_cast<int32_t>(bound));
    const __m256 divisor8 = _mm256_set1_ps(divisor);
    __m256i largest8 = _mm256_setzero_si256();
    for (; i + 8 <= end; i += 8) {
      __m256 acc = _mm256_div_ps(_mm256_loadu_ps(g + i), divisor8);  // same roundings as compensate()
      if (add_residual) acc = _mm256_add_ps(acc, _mm256_loadu_ps(r + i));
      const __m256i keys = magnitude_keys(acc);
      largest8 = _mm256_max_epu32(largest8, keys);
      if (r) _mm256_storeu_ps(r + i, acc);
      uint32_t hits = keys_at_or_above(keys, bound8);
      if (!hits) continue;
      alignas(32) float lane[8];
      _mm256_store_ps(lane, acc);
      count = append_hits<kSent>(lane, hits, i, r, slab_index, slab_value, capacity, count);
    }
    largest = max_lane(largest8);
  }
#elif defined(__SSE2__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<V, float>) {
    // The default level on x86-64 (SSE2, which every such CPU has): 4 entries per step as
    // above. The compiler does not vectorise the scalar loop below (its unsigned min and
    // data-dependent appends), which made the pass 2x the read-read-write floor. Keys are
    // below 2^31, so SSE2's signed compares order them as unsigned ones would.
    const __m128i magnitude_mask = _mm_set1_epi32(0x7FFFFFFF);
    const __m128i nan_key = _mm_set1_epi32(static_cast<int32_t>(kNanKey));
    const __m128i below_bound = _mm_set1_epi32(static_cast<int32_t>(bound) - 1);  // key > this: key >= bound
    const __m128 divisor4 = _mm_set1_ps(divisor);
    __m128i largest4 = _mm_setzero_si128();
    for (; i + 4 <= end; i += 4) {
      __m128 acc = _mm_div_ps(_mm_loadu_ps(g + i), divisor4);  // same roundings as compensate()
      if (add_residual) acc = _mm_add_ps(acc, _mm_loadu_ps(r + i));
      const __m128i magnitude = _mm_and_si128(_mm_castps_si128(acc), magnitude_mask);
      const __m128i is_nan = _mm_cmpgt_epi32(magnitude, nan_key);
      const __m128i keys = _mm_or_si128(_mm_andnot_si128(is_nan, magnitude), _mm_and_si128(is_nan, nan_key));
      const __m128i larger = _mm_cmpgt_epi32(keys, largest4);
      largest4 = _mm_or_si128(_mm_and_si128(larger, keys), _mm_andnot_si128(larger, largest4));
      if (r) _mm_storeu_ps(r + i, acc);
      uint32_t hits = static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(keys, below_bound))));
      if (!hits) continue;
      alignas(16) float lane[4];
      _mm_store_ps(lane, acc);
      count = append_hits<kSent>(lane, hits, i, r, slab_index, slab_value, capacity, count);
    }
    alignas(16) uint32_t lane_largest[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(lane_largest), largest4);
    largest = *std::max_element(lane_largest, lane_largest + 4);
  }
#endif
  for (; i < end; ++i) {
    const T a = compensate<T>(g[i], divisor, add_residual ? r + i : nullptr);
    const float af = to_float(a);
    const uint32_t key = magnitude_key(af);
    const bool hit = key >= bound;
    largest = std::max(largest, key);
    if (r) {
      const bool tentative = kSent == SentResidual::remainder && hit && count < capacity;
      r[i] = tentative ? sent_remainder<T, V>(af, to_wire<T, V>(af)) : a;
    }
    if (hit) {
      if (count < capacity) {
        slab_index[count] = static_cast<int32_t>(i);
        slab_value[count] = af;
      }
      ++count;
    }
  }
  *largest_key = largest;
  return count;
}

// The streaming pass split into ranges (one per thread, at most 64), range t appending to
// its own slab of `capacity` entries in `slabs` (grown as needed, then reused). Returns
// how many entries reached the bound per range; the stored ones are lists[t].
struct Collected {
  std::vector<int64_t> bounds;  // range t is [bounds[t], bounds[t + 1])
  std::vector<int64_t> found;
  std::vector<uint32_t> largest_key;  // per range: >= kInfKey if some acc there is +-Inf or NaN
  std::vector<CandidateList> lists;
  int64_t total = 0;
  bool overflow = false;  // some range found more than it could store
};

template <typename T, typename V, SentResidual kSent = SentResidual::remainder>
Collected collect_in_ranges(const T* g, T* r, float divisor, bool add_residual, uint32_t bound, int64_t n,
                            int64_t capacity, Slabs& slabs) {
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), 64));
  if (static_cast<int64_t>(slabs.index.size()) < ranges * capacity) {
    slabs.index.resize(ranges * capacity);
    slabs.value.resize(ranges * capacity);
  }
  Collected c;
  for (int64_t t = 0; t <= ranges; ++t) c.bounds.push_back(n * t / ranges);
  c.found.assign(ranges, 0);
  c.largest_key.assign(ranges, 0);
  at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      c.found[t] = collect_candidates<T, V, kSent>(g, r, divisor, add_residual, bound, c.bounds[t], c.bounds[t + 1],
                                            slabs.index.data() + t * capacity, slabs.value.data() + t * capacity,
                                            capacity, &c.largest_key[t]);
    }
  });
  for (int64_t t = 0; t < ranges; ++t) {
    c.total += c.found[t];
    c.overflow |= c.found[t] > capacity;
    c.lists.push_back({slabs.index.data() + t * capacity, slabs.value.data() + t * capacity,
                       std::min(c.found[t], capacity)});
  }
  return c;
}

enum class Sampled {
  done,          // payload and residual written
  not_tried,     // bucket too small or density too high: nothing was touched
  bound_failed,  // the pass ran (acc is in the residual, if any) but the bound did not hold
};

// The whole strategy. The payload lists the selected entries in index order (ranges in
// order, each in index order).
template <typename T, typename V, SentResidual kSent = SentResidual::remainder>
Sampled sampled_topk_pack(const T* g, T* r, float divisor, bool add_residual, int64_t n, int64_t k, int32_t* out_index,
                       V* out_value, int32_t index_offset) {
  uint32_t bound = 0;
  int64_t expected = 0;
  if (!sample_bound<T>(g, r, divisor, add_residual, n, k, &bound, &expected)) return Sampled::not_tried;
  // Each range may hold all candidates (gradients of one layer can dominate a bucket).
  const int64_t capacity = expected + expected / 4 + 4096;
  const Collected c = collect_in_ranges<T, V, kSent>(g, r, divisor, add_residual, bound, n, capacity,
                                                     sampled_slabs());
  const int64_t ranges = static_cast<int64_t>(c.lists.size());
  if (c.overflow || c.total < k) {  // put acc back where the pass left a tentative remainder
    if (kSent == SentResidual::remainder && r) {
      at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
        for (int64_t t = first; t < last; ++t) {
          for (int64_t j = 0; j < c.lists[t].size; ++j) r[c.lists[t].index[j]] = static_cast<T>(c.lists[t].value[j]);
        }
      });
    }
    return Sampled::bound_failed;
  }
  const std::vector<CandidateList>& lists = c.lists;
  const Selection selection = select_candidates(lists, k, 0, 0, 0);
  std::vector<int64_t> position(ranges + 1, 0);
  for (int64_t t = 0; t < ranges; ++t) position[t + 1] = position[t] + selection.taken(t);
  at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t end = emit_selected<T, V>(lists[t], selection, t, r, out_index, out_value, position[t], index_offset,
                                              kSent == SentResidual::remainder ? Residual::restore_unsent
                                                                               : Residual::untouched);
      TORCH_INTERNAL_ASSERT(end == position[t + 1]);
    }
  });
  return Sampled::done;
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
