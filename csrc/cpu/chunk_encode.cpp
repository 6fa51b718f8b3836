// Fused error feedback + chunked top-k + index and value codecs on CPU (selector="chunk").
//
// Bit for bit what sparsecomm/compress/chunk_layout.py's ChunkLayout.encode writes for
// acc = compensated(grad, residual, divisor, add_residual), in one pass over the bucket:
// each chunk (<= 65536 entries) is read once from grad and the residual, and everything
// after that works on it while it sits in L1/L2.
//
//   1. One streaming loop (memory-bound: the work in it is nearly free) forms acc, writes
//      it to the residual (which doubles as the chunk's acc until the chunk is coded) and
//      collects the candidates: the positions, in index order, of the entries whose key
//      reaches a bar estimated from the chunk before (AVX-512: compressed in registers;
//      AVX2: permuted by a table; the baseline: two per 16 entries without a branch).
//      The bar is a key that about k + 3 sqrt(k) + 8 of the previous chunk's entries
//      reached: neighbouring chunks of a bucket mostly hold the same tensor.
//   2. If at least k entries reached it, the top k are among them (every other entry is
//      below k of them). If not (a thread's first chunk, a chunk of smaller values than
//      the one before: ~0.2% of chunks of random data), a bound takes its place, from the
//      cached chunk: a key B at or below the k-th largest of the key maxima of G ~ 3k
//      disjoint groups is at or below the chunk's k-th largest key (k groups each hold an
//      entry >= B), and ~50 entries reach it (k = 41 of 4096). Either way the exact k-th
//      largest candidate key is found bit by bit with vectorised counts (only the bits in
//      which the candidates differ, and only until exactly k reach the bound), together
//      with the next chunk's bar, and the top k taken: every key above the k-th, then keys
//      equal to it by lower index. The bar decides how the candidates are found, never
//      what is selected.
//   3. Scale, codes, decoded values, index and value bits, and the residual of the sent
//      entries (acc - decoded where that is finite, acc where it is not); a chunk with a
//      non-finite acc first has those zeroed in its residual (rare: a running key maximum
//      of step 1 tells).
//
// grad / divisor is grad times the inverse where that gives the same bits (a power-of-two
// divisor): a division costs several times a product, which the baseline and AVX2 levels
// felt even in a memory-bound loop.
//
// Chunks are shared out in runs of 8: 8 chunks of every codec end on a byte boundary, so
// no two threads write one payload byte. The result does not depend on the thread count.
#include "chunk_codecs.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

constexpr int64_t kChunksPerRun = 8;
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxStripes = 64;  // up to 1024 groups: the bound serves k <= 1024
// Keys are compared unclamped (the bits of |acc|: NaNs above kNanKey) against bars of at
// most kNanKey, which orders them as magnitude_key would; all of them are below 2^31, so
// signed compares serve (SSE2 and AVX2 have no unsigned ones). kNanKey as a bar admits the
// NaNs only: the bar of a thread's first chunk.
constexpr uint32_t kFirstBar = kNanKey;
// The next chunk's bar is a key that k + 3 sqrt(k) + 8 of this chunk's entries reach
// (k = 41: 68; ~0.2% of chunks of randn or Student-t data then find fewer than k; simulated
// with torch), to kEstimateLowBit: 7 mantissa bits. Without that many candidates to read it from: the
// lowest candidate key less kEstimateMargin (exact: a power of two apart).
constexpr int kEstimateLowBit = 16;
constexpr float kEstimateMargin = 0.875f;

struct Workspace {
  std::vector<float> acc;  // a chunk's acc when there is no residual to hold it
  std::vector<uint32_t> group_max;
  std::vector<int32_t> position;  // candidates: chunk positions, ascending
  std::vector<float> value;       // their acc (gathered)
  std::vector<uint32_t> key;      // their keys
  std::vector<int32_t> selected;  // the top k: positions, ascending
  std::vector<float> selected_value;
  std::vector<uint32_t> code;  // the selected entries' value codes
  std::vector<float> decoded;  // and what they decode to

  void fit(int64_t chunk_size) {
    if (static_cast<int64_t>(acc.size()) >= chunk_size) return;
    acc.resize(chunk_size);
    position.resize(chunk_size + kLanes);  // slack for whole-vector stores
    value.resize(chunk_size + kLanes);
    key.resize(chunk_size + kLanes);
    selected.resize(chunk_size + kLanes);
    selected_value.resize(chunk_size + kLanes);
    code.resize(chunk_size);
    decoded.resize(chunk_size);
    group_max.resize(kMaxStripes * kLanes);
  }
};

Workspace& workspace() {
  static thread_local Workspace ws;
  return ws;
}

// What scan_chunk does with acc: form it (grad / divisor, plus the residual it is written
// over), or read it back from the cached chunk (the bound's collection).
enum class Scan { accumulate, divide, reread };

// Whether grad / divisor == grad * (1 / divisor) for every grad: divisor a power of two
// whose inverse is a normal float. Both are then the correctly rounded value of the same
// real number (subnormal results and NaNs alike), and a product costs a fraction of a
// quotient (world sizes are mostly powers of two).
inline bool exact_inverse(float divisor) {
  int exponent;
  return std::fabs(std::frexp(divisor, &exponent)) == 0.5f && std::isnormal(1.0f / divisor);
}

#if SPARSECOMM_CPU_LEVEL == SPARSECOMM_CPU_AVX2
// Lane indices of every 8-bit mask's set lanes, packed to the front (a byte each): the
// permutation that compresses 8 lanes, as AVX-512's compress does in one instruction.
struct CompressTable {
  uint64_t lanes[256] = {};
};
constexpr CompressTable kCompress8 = [] {
  CompressTable table;
  for (int mask = 0; mask < 256; ++mask) {
    int packed = 0;
    for (int lane = 0; lane < 8; ++lane) {
      if (mask >> lane & 1) table.lanes[mask] |= static_cast<uint64_t>(lane) << (8 * packed++);
    }
  }
  return table;
}();

// Stores the lanes of `take` of a, packed, at out (room for 8); returns how many.
template <typename T>
inline int64_t compress8(uint32_t take, __m256i a, T* out) {
  const __m256i order = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(&kCompress8.lanes[take])));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(a, order));
  return __builtin_popcount(take);
}
#endif

// One loop over a chunk: acc into acc[] (accumulate, divide: grad / divisor, or grad *
// divisor where kByInverse has made it the exact inverse), and the positions of the entries
// whose key reaches `bar` (<= kNanKey) appended in index order to position (room for
// length + kLanes). Returns how many; *non_finite is set if some acc is +-Inf or NaN.
template <Scan kScan, bool kByInverse = false>
int64_t scan_chunk(const float* g, float* acc, float divisor, int64_t length, uint32_t bar, int32_t* position,
                   bool* non_finite) {
  int64_t m = 0, j = 0;
  uint32_t largest = 0;
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
  const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i bar16 = _mm512_set1_epi32(static_cast<int32_t>(bar));
  const __m512 divisor16 = _mm512_set1_ps(divisor);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i largest16 = _mm512_setzero_si512();
  for (; j + 16 <= length; j += 16) {
    __m512 a;
    if constexpr (kScan == Scan::reread) {
      a = _mm512_loadu_ps(acc + j);
    } else {
      a = kByInverse ? _mm512_mul_ps(_mm512_loadu_ps(g + j), divisor16) : _mm512_div_ps(_mm512_loadu_ps(g + j), divisor16);
      if constexpr (kScan == Scan::accumulate) a = _mm512_add_ps(a, _mm512_loadu_ps(acc + j));
      _mm512_storeu_ps(acc + j, a);
    }
    const __m512i keys = _mm512_and_si512(_mm512_castps_si512(a), magnitude_mask);
    largest16 = _mm512_max_epu32(largest16, keys);
    // Compress in registers and store all 16 lanes (the buffers have 16 entries of slack):
    // compress to memory is microcoded on some CPUs (AMD Zen 4), and a branch on `hits`
    // would be mispredicted at about one vector in four.
    const __mmask16 hits = _mm512_cmpge_epu32_mask(keys, bar16);
    _mm512_storeu_si512(position + m, _mm512_maskz_compress_epi32(hits, index));
    m += __builtin_popcount(hits);
    index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
  }
  largest = _mm512_reduce_max_epu32(largest16);
#elif SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
  const __m256i magnitude_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i below_bar = _mm256_set1_epi32(static_cast<int32_t>(bar) - 1);  // key > this: key >= bar
  const __m256 divisor8 = _mm256_set1_ps(divisor);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i largest8 = _mm256_setzero_si256();
  for (; j + 8 <= length; j += 8) {
    __m256 a;
    if constexpr (kScan == Scan::reread) {
      a = _mm256_loadu_ps(acc + j);
    } else {
      a = kByInverse ? _mm256_mul_ps(_mm256_loadu_ps(g + j), divisor8) : _mm256_div_ps(_mm256_loadu_ps(g + j), divisor8);
      if constexpr (kScan == Scan::accumulate) a = _mm256_add_ps(a, _mm256_loadu_ps(acc + j));
      _mm256_storeu_ps(acc + j, a);
    }
    const __m256i keys = _mm256_and_si256(_mm256_castps_si256(a), magnitude_mask);
    largest8 = _mm256_max_epi32(largest8, keys);
    const uint32_t hits = static_cast<uint32_t>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, below_bar))));
    m += compress8(hits, index, position + m);
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  largest = max_lane(largest8);
#elif defined(__SSE2__)
  // The default level on x86-64: 4 entries per step, 16 per test of the bar (no compress
  // or shuffle instruction to append with).
  const __m128i magnitude_mask = _mm_set1_epi32(0x7FFFFFFF);
  const __m128i below_bar = _mm_set1_epi32(static_cast<int32_t>(bar) - 1);
  const __m128i below_inf = _mm_set1_epi32(static_cast<int32_t>(kInfKey) - 1);
  const __m128 divisor4 = _mm_set1_ps(divisor);
  __m128i non_finite4 = _mm_setzero_si128();
  for (; j + 16 <= length; j += 16) {
    uint32_t hits = 0;
    for (int quarter = 0; quarter < 4; ++quarter) {
      const int64_t q = j + 4 * quarter;
      __m128 a;
      if constexpr (kScan == Scan::reread) {
        a = _mm_loadu_ps(acc + q);
      } else {
        a = kByInverse ? _mm_mul_ps(_mm_loadu_ps(g + q), divisor4) : _mm_div_ps(_mm_loadu_ps(g + q), divisor4);
        if constexpr (kScan == Scan::accumulate) a = _mm_add_ps(a, _mm_loadu_ps(acc + q));
        _mm_storeu_ps(acc + q, a);
      }
      const __m128i keys = _mm_and_si128(_mm_castps_si128(a), magnitude_mask);
      non_finite4 = _mm_or_si128(non_finite4, _mm_cmpgt_epi32(keys, below_inf));
      hits |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(keys, below_bar))))
              << (4 * quarter);
    }
    // The first two hits without a branch (a vector holds at most two but about one time
    // in 300), the others one by one.
    const uint32_t second = hits & (hits - 1);
    position[m] = static_cast<int32_t>(j + __builtin_ctz(hits | 0x10000u));
    m += hits != 0;
    position[m] = static_cast<int32_t>(j + __builtin_ctz(second | 0x10000u));
    m += second != 0;
    for (uint32_t rest = second & (second - 1); rest; rest &= rest - 1) {
      position[m++] = static_cast<int32_t>(j + __builtin_ctz(rest));
    }
  }
  largest = _mm_movemask_ps(_mm_castsi128_ps(non_finite4)) ? kInfKey : 0;
#endif
  // The rest (every entry on a CPU without a vector path): one at a time, branch-free
  // (most entries are not taken).
  for (; j < length; ++j) {
    float a;
    if constexpr (kScan == Scan::reread) {
      a = acc[j];
    } else {
      a = kByInverse ? g[j] * divisor : g[j] / divisor;
      if constexpr (kScan == Scan::accumulate) a = a + acc[j];
      acc[j] = a;
    }
    const uint32_t key = float_bits(a) & 0x7FFFFFFFu;
    largest = std::max(largest, key);
    position[m] = static_cast<int32_t>(j);
    m += key >= bar;
  }
  *non_finite = largest >= kInfKey;
  return m;
}

// For each rank[r]: the largest t whose count {j : keys[j] >= t} is >= rank[r], among the
// t that agree with t[r] above bit `high`, built bit by bit from `high` down to low[r] (the
// count only falls as t grows): with low[r] == 0, the rank-th largest key, when that agrees
// with t[r] above `high`; a t at or below it otherwise. A rank stops early once exactly
// rank[r] keys reach its t (exact[r]): the bits left cannot change which keys those are,
// and the rank-th largest is the least of them. Each step is one vectorised count per rank
// still searching; the ranks' steps are independent, so their latencies overlap. Keys and t
// are below 2^31; m is a multiple of kLanes (keys of 0 pad: t is never 0).
template <int kRanks>
void kth_largest(const uint32_t* keys, int64_t m, const int64_t (&rank)[kRanks], uint32_t (&t)[kRanks],
                 bool (&exact)[kRanks], int high, const int (&low)[kRanks]) {
  for (int r = 0; r < kRanks; ++r) exact[r] = false;
  for (int bit = high;; --bit) {
    bool searching[kRanks], any = false;
    for (int r = 0; r < kRanks; ++r) any |= searching[r] = bit >= low[r] && !exact[r];
    if (!any) return;
    uint32_t trial[kRanks];
    int32_t count[kRanks] = {};  // m <= 65536 + kLanes
    for (int r = 0; r < kRanks; ++r) trial[r] = t[r] | (1u << bit);
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
    // A mask and its popcount per 16 keys: no horizontal sum per bit.
    __m512i trial16[kRanks];
    for (int r = 0; r < kRanks; ++r) trial16[r] = _mm512_set1_epi32(static_cast<int32_t>(trial[r]));
    for (int64_t j = 0; j < m; j += 16) {
      const __m512i block = _mm512_loadu_si512(keys + j);
      for (int r = 0; r < kRanks; ++r) count[r] += __builtin_popcount(_mm512_cmpge_epu32_mask(block, trial16[r]));
    }
#elif SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
    __m256i below8[kRanks];
    for (int r = 0; r < kRanks; ++r) below8[r] = _mm256_set1_epi32(static_cast<int32_t>(trial[r]) - 1);
    for (int64_t j = 0; j < m; j += 8) {
      const __m256i block = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + j));
      for (int r = 0; r < kRanks; ++r) {
        count[r] += __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(block, below8[r]))));
      }
    }
#else
    for (int64_t j = 0; j < m; ++j) {
      for (int r = 0; r < kRanks; ++r) count[r] += static_cast<int32_t>(keys[j]) >= static_cast<int32_t>(trial[r]);
    }
#endif
    for (int r = 0; r < kRanks; ++r) {  // unpredictable: no branch
      const bool take = searching[r] && count[r] >= rank[r];
      t[r] = take ? trial[r] : t[r];
      exact[r] = exact[r] || (take && count[r] == rank[r]);
    }
  }
}

// The least of the keys at or above t (m as for kth_largest).
uint32_t least_at_or_above(const uint32_t* keys, int64_t m, uint32_t t) {
  uint32_t least = 0xFFFFFFFFu;
  for (int64_t j = 0; j < m; ++j) least = std::min(least, keys[j] >= t ? keys[j] : 0xFFFFFFFFu);
  return least;
}

// Bits of the group-maximum bound: 16 (exponent and 7 mantissa bits) give a bar at most
// 2^-7 (relative) below the exact k-th maximum, for half the steps.
constexpr int kBoundBits = 16;

// A key at or below the k-th largest of a cached chunk's acc (0 where no bound serves):
// the k-th largest key maxima of G ~ 3k disjoint groups (lane x stripe of 16-entry
// vectors), to kBoundBits bits.
uint32_t group_bound(const float* acc, int64_t length, int64_t k, uint32_t* group_max) {
  const int64_t vectors = length / kLanes;
  const int64_t most = std::min(kMaxStripes, std::max<int64_t>(vectors, 1));
  const int64_t stripes = std::clamp<int64_t>((3 * k + kLanes - 1) / kLanes, 1, most);
  if (vectors < stripes || stripes * kLanes < k) return 0;  // a group without entries, or fewer than k groups
  std::fill(group_max, group_max + stripes * kLanes, 0u);
  int64_t stripe = 0;
  for (int64_t v = 0; v < vectors; ++v) {
    uint32_t* maxima = group_max + stripe * kLanes;
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      maxima[lane] = std::max(maxima[lane], magnitude_key(acc[v * kLanes + lane]));
    }
    if (++stripe == stripes) stripe = 0;
  }
  uint32_t bound[1] = {0};
  bool exact[1];
  kth_largest<1>(group_max, stripes * kLanes, {k}, bound, exact, 30, {31 - kBoundBits});
  return bound[0];
}

// The first `count` set bits of mask (count < popcount(mask)).
inline uint32_t lowest_bits(uint32_t mask, int64_t count) {
  uint32_t kept = 0;
  for (; count > 0; --count, mask &= mask - 1) kept |= mask & -mask;
  return kept;
}

// Step 2: the chunk's top k of its m candidates (ws.position, in index order: every entry
// reaching some bar) into ws.selected/selected_value, ties to lower positions. Returns the
// bar for the next chunk (see kEstimateMargin).
uint32_t select_chunk(Workspace& ws, const float* acc, int64_t m, int64_t k) {
  const int32_t* position = ws.position.data();
  float* value = ws.value.data();
  uint32_t* key = ws.key.data();
  uint32_t lowest = kFirstBar, highest = 0;
  for (int64_t c = 0; c < m; ++c) {
    value[c] = acc[position[c]];
    key[c] = magnitude_key(value[c]);
    lowest = std::min(lowest, key[c]);
    highest = std::max(highest, key[c]);
  }
  // Zero keys up to a whole vector: every trial t is positive, so they count nowhere, and
  // the counts need no scalar tail.
  const int64_t whole = (m + kLanes - 1) / kLanes * kLanes;
  std::fill(key + m, key + whole, 0u);
  // Keys ranked here lie in [lowest, highest]: they agree with both above the highest bit
  // in which those differ, and only the bits from there down are left to find.
  const uint32_t differ = lowest ^ highest;
  const int high = differ ? 31 - __builtin_clz(differ) : -1;
  const uint32_t prefix = high >= 0 ? highest & ~((2u << high) - 1) : highest;
  const int64_t reach = k + static_cast<int64_t>(3.0 * std::sqrt(static_cast<double>(k))) + 8;
  // The k-th largest key (k == m: the lowest), and one that about `reach` keys reach.
  uint32_t found[2] = {lowest, lowest};
  if (k < m) {
    found[0] = found[1] = prefix;
    bool exact[2];
    kth_largest<2>(key, whole, {k, std::min(reach, m)}, found, exact, high, {0, kEstimateLowBit});
    for (int r = 0; r < 2; ++r) found[r] = exact[r] ? least_at_or_above(key, whole, found[r]) : found[r];
  }
  const uint32_t kth = found[0];
  const uint32_t estimate = reach <= m ? found[1] : magnitude_key(key_as_float(lowest) * kEstimateMargin);

  int64_t above = 0;
  for (int64_t c = 0; c < m; ++c) above += key[c] > kth;
  int64_t ties = k - above, taken = 0, c = 0;  // keys equal to the k-th: the lowest positions
  int32_t* selected = ws.selected.data();
  float* selected_value = ws.selected_value.data();
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
  const __m512i kth16 = _mm512_set1_epi32(static_cast<int32_t>(kth));
  for (; c + 16 <= m; c += 16) {
    const __m512i keys = _mm512_loadu_si512(key + c);
    uint32_t equal = _mm512_cmpeq_epu32_mask(keys, kth16);
    const int64_t tied = __builtin_popcount(equal);
    if (tied > ties) equal = lowest_bits(equal, ties);
    ties -= std::min(tied, ties);
    const __mmask16 take = _mm512_cmpgt_epu32_mask(keys, kth16) | static_cast<__mmask16>(equal);
    _mm512_storeu_si512(selected + taken, _mm512_maskz_compress_epi32(take, _mm512_loadu_si512(position + c)));
    _mm512_storeu_ps(selected_value + taken, _mm512_maskz_compress_ps(take, _mm512_loadu_ps(value + c)));
    taken += __builtin_popcount(take);
  }
#elif SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
  const __m256i kth8 = _mm256_set1_epi32(static_cast<int32_t>(kth));
  for (; c + 8 <= m; c += 8) {
    const __m256i keys = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + c));
    uint32_t equal = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(keys, kth8))));
    const int64_t tied = __builtin_popcount(equal);
    if (tied > ties) equal = lowest_bits(equal, ties);
    ties -= std::min(tied, ties);
    const uint32_t take =
        static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, kth8)))) | equal;
    compress8(take, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + c)), selected_value + taken);
    taken += compress8(take, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(position + c)), selected + taken);
  }
#endif
  for (; c < m; ++c) {  // branch-free: whether an entry is taken is unpredictable
    const int64_t equal = key[c] == kth;
    const int64_t take = (key[c] > kth) | (equal & (ties > 0));
    ties -= equal & take;
    selected[taken] = position[c];
    selected_value[taken] = value[c];
    taken += take;
  }
  TORCH_INTERNAL_ASSERT(taken == k, "chunk_encode: selected ", taken, " of k=", k);
  return std::min(estimate, kFirstBar);
}

struct Outputs {
  uint8_t* payload;
  int64_t* indices;
  void* decoded;  // float32 for scaled codecs and fp32, 16-bit wire values for bf16/fp16
  float* residual;
};

// The index region of chunk c (selected: its k positions, ascending).
void emit_indices(const ChunkFormat& f, const int32_t* selected, int64_t c, int64_t k, const Outputs& out,
                  BitWriter* index_bits) {
  const int64_t begin = c * f.chunk_size, first = c * f.k_full;
  for (int64_t j = 0; j < k; ++j) out.indices[first + j] = begin + selected[j];
  BitWriter bits = *index_bits;  // a local copy stays in registers: the payload stores cannot alias it
  if (f.index_codec == kIndexInt32) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t index = static_cast<int32_t>(begin + selected[j]);
      std::memcpy(out.payload + f.index_start + 4 * (first + j), &index, 4);
    }
  } else if (f.index_codec == kIndexChunk) {
    for (int64_t j = 0; j < k; ++j) bits.put(static_cast<uint32_t>(selected[j]), f.index_bits);
  } else {
    const bool last = c == f.chunks - 1;
    const int r = last ? f.rice_r_last : f.rice_r_full;
    const int64_t chunk_bits = last ? f.rice_bits_last : f.rice_bits_full;
    const uint32_t low_mask = (1u << r) - 1;
    int64_t written = 0, previous = -1;
    for (int64_t j = 0; j < k; ++j) {
      const uint32_t gap = static_cast<uint32_t>(selected[j] - previous - 1);
      const int64_t quotient = gap >> r;
      const int width = static_cast<int>(quotient) + 1 + r;
      if (width <= 32) {  // the usual code: quotient ones, a zero, r low bits, in one field
        bits.put(((uint64_t{1} << quotient) - 1) | uint64_t{gap & low_mask} << (quotient + 1), width);
      } else {
        bits.put_ones(quotient);
        bits.put(0, 1);
        bits.put(gap & low_mask, r);
      }
      written += width;
      previous = selected[j];
    }
    bits.put_zeros(chunk_bits - written);
  }
  *index_bits = bits;
}

// The value region, decoded values and the residual of the sent entries of chunk c, for a
// value codec known at compile time (the per-entry code then has no codec branches).
template <int32_t kCodec>
void emit_values(const ChunkFormat& f, Workspace& ws, int64_t c, int64_t k, const Outputs& out,
                 BitWriter* value_bits) {
  constexpr bool kScaled = kCodec >= kValueFp8;  // as dispatch/chunk_format.cpp sets f.scaled
  const int64_t begin = c * f.chunk_size, first = c * f.k_full;
  const int32_t* selected = ws.selected.data();
  const float* value = ws.selected_value.data();
  uint32_t* code = ws.code.data();
  float scale = 0.0f;
  if constexpr (kScaled) {
    scale = chunk_scale(kCodec, value, k);
    const uint16_t bits = static_cast<uint16_t>(float_bits(scale) >> 16);
    std::memcpy(out.payload + 2 * c, &bits, 2);
  }
  // Codes and decoded values (without branches: vectorised where the level allows), then
  // the scattered residual writes.
  float* decoded = ws.decoded.data();
  for (int64_t j = 0; j < k; ++j) {
    if constexpr (kScaled) {
      code[j] = value_code(kCodec, value[j], scale);
      decoded[j] = decode_code(kCodec, code[j], scale);
    } else {
      code[j] = float_wire_bits(kCodec, value[j]);
      decoded[j] = float_wire_value(kCodec, code[j]);
    }
  }
  if constexpr (kScaled) {
    std::memcpy(static_cast<float*>(out.decoded) + first, decoded, 4 * k);
  } else if constexpr (kCodec == kValueFp32) {
    std::memcpy(static_cast<float*>(out.decoded) + first, code, 4 * k);
  } else {
    for (int64_t j = 0; j < k; ++j) static_cast<uint16_t*>(out.decoded)[first + j] = static_cast<uint16_t>(code[j]);
  }
  if (out.residual != nullptr) {
    for (int64_t j = 0; j < k; ++j) {
      // A non-finite acc leaves 0 (zeroed before, see encode_runs); a non-finite decoded
      // value (a chunk with an Inf/NaN) sends nothing usable, so the finite acc stays.
      const float v = value[j];
      if (std::isfinite(v)) out.residual[begin + selected[j]] = std::isfinite(decoded[j]) ? v - decoded[j] : v;
    }
  }
  // Codes concatenated into 32-bit words first (every width divides 32): one put per word.
  BitWriter bits = *value_bits;  // in registers, as in emit_indices
  const int width = f.value_bits, per_word = 32 / width;
  int64_t j = 0;
  for (; j + per_word <= k; j += per_word) {
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) word |= code[j + i] << (i * width);
    bits.put(word, 32);
  }
  for (; j < k; ++j) bits.put(code[j], width);
  *value_bits = bits;
}

void emit_chunk(const ChunkFormat& f, Workspace& ws, int64_t c, int64_t k, const Outputs& out, BitWriter* index_bits,
                BitWriter* value_bits) {
  emit_indices(f, ws.selected.data(), c, k, out, index_bits);
  switch (f.value_codec) {
    case kValueFp32: return emit_values<kValueFp32>(f, ws, c, k, out, value_bits);
    case kValueBf16: return emit_values<kValueBf16>(f, ws, c, k, out, value_bits);
    case kValueFp16: return emit_values<kValueFp16>(f, ws, c, k, out, value_bits);
    case kValueFp8: return emit_values<kValueFp8>(f, ws, c, k, out, value_bits);
    case kValueInt8: return emit_values<kValueInt8>(f, ws, c, k, out, value_bits);
    case kValueInt4: return emit_values<kValueInt4>(f, ws, c, k, out, value_bits);
    case kValueInt2: return emit_values<kValueInt2>(f, ws, c, k, out, value_bits);
    default: return emit_values<kValueSign>(f, ws, c, k, out, value_bits);
  }
}

// +0 for every non-finite acc of a chunk's residual (before the sent entries get theirs).
void zero_non_finite(float* r, int64_t length) {
  for (int64_t j = 0; j < length; ++j) r[j] = std::isfinite(r[j]) ? r[j] : 0.0f;
}

template <bool kResidual, bool kAdd>
void encode_runs(const ChunkFormat& f, const float* g, float divisor, const Outputs& out) {
  const int64_t runs = (f.chunks + kChunksPerRun - 1) / kChunksPerRun;
  at::parallel_for(0, runs, 1, [&](int64_t first_run, int64_t last_run) {
    Workspace& ws = workspace();
    ws.fit(f.chunk_size);
    const int64_t c0 = first_run * kChunksPerRun, c1 = std::min(last_run * kChunksPerRun, f.chunks);
    // Every run starts on a byte of both regions (c0 is a multiple of 8).
    int64_t index_bit = 0;
    if (f.index_codec == kIndexChunk) index_bit = c0 * f.k_full * f.index_bits;
    if (f.index_codec == kIndexRice) index_bit = c0 * f.rice_bits_full;
    BitWriter index_bits(out.payload + f.index_start + index_bit / 8);
    BitWriter value_bits(out.payload + f.value_start + c0 * f.k_full * f.value_bits / 8);
    uint32_t estimate = kFirstBar;  // no chunk before
    const bool by_inverse = exact_inverse(divisor);
    const float inverse = 1.0f / divisor;
    for (int64_t c = c0; c < c1; ++c) {
      const bool last = c == f.chunks - 1;
      const int64_t length = last ? f.last_length : f.chunk_size, k = last ? f.k_last : f.k_full;
      const int64_t begin = c * f.chunk_size;
      float* acc = kResidual ? out.residual + begin : ws.acc.data();
      const uint32_t bar = k == length ? 0 : estimate;  // everything sent: all are candidates
      bool non_finite = false;
      constexpr Scan kForm = kAdd ? Scan::accumulate : Scan::divide;
      int64_t m = by_inverse ? scan_chunk<kForm, true>(g + begin, acc, inverse, length, bar, ws.position.data(), &non_finite)
                             : scan_chunk<kForm>(g + begin, acc, divisor, length, bar, ws.position.data(), &non_finite);
      if (m < k) {  // the estimate was too high (or there was none): the bound decides
        bool unused;
        m = scan_chunk<Scan::reread>(nullptr, acc, divisor, length, group_bound(acc, length, k, ws.group_max.data()),
                                     ws.position.data(), &unused);
      }
      estimate = select_chunk(ws, acc, m, k);
      if (kResidual && non_finite) zero_non_finite(acc, length);
      emit_chunk(f, ws, c, k, out, &index_bits, &value_bits);
    }
    index_bits.finish();
    value_bits.finish();
  });
}

}  // namespace

// Arguments checked by the caller (dispatch/cpu_ops.cpp): grad float32, residual float32
// of grad's size (or none), payload uint8 of f.nbytes, indices int64 and decoded of
// f.selected entries.
void chunk_encode(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, float divisor,
                  bool add_residual, const ChunkFormat& f, const at::Tensor& payload, const at::Tensor& indices,
                  const at::Tensor& decoded) {
  const Outputs out{payload.mutable_data_ptr<uint8_t>(), indices.mutable_data_ptr<int64_t>(), decoded.data_ptr(),
                    residual.has_value() ? residual->mutable_data_ptr<float>() : nullptr};
  const float* g = grad.const_data_ptr<float>();
  if (out.residual == nullptr) {
    encode_runs<false, false>(f, g, divisor, out);
  } else if (add_residual) {
    encode_runs<true, true>(f, g, divisor, out);
  } else {
    encode_runs<true, false>(f, g, divisor, out);
  }
  std::memset(out.payload + f.value_end, 0, f.nbytes - f.value_end);
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
