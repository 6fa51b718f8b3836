// Fused error feedback + chunked top-k + index and value codecs on CPU (selector="chunk").
//
// Bit for bit what sparsecomm/compress/chunk_layout.py's ChunkLayout.encode writes for
// acc = compensated(grad, residual, divisor, add_residual), in one pass over the bucket.
// Each chunk (<= 65536 entries) is worked on while it sits in L1/L2:
//
//   1. acc, its magnitude keys and the residual's provisional value (acc, or 0 where acc is
//      not finite) in one vectorised loop, which also keeps the key maxima of G disjoint
//      groups of entries (group = lane x stripe of 16-entry vectors, no horizontal step).
//   2. A key B at or below the k-th largest group maximum is at or below the chunk's k-th
//      largest key (k groups each hold an entry >= B), and few entries reach it (~50 for
//      k = 41 of 4096 with G = 128): the entries with key >= B are collected in index
//      order (AVX-512: compressed in registers), their exact k-th largest key is found bit
//      by bit with vectorised counts (no data-dependent branch but one per bit), and the
//      top k taken: every key above the k-th, then keys equal to it by lower index.
//   3. Scale, codes, decoded values, index and value bits, and the residual of the sent
//      entries (acc - decoded where that is finite, acc where it is not).
//
// Chunks are shared out in runs of 8: 8 chunks of every codec end on a byte boundary, so
// no two threads write one payload byte. The result does not depend on the thread count.
#include "chunk_codecs.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

constexpr int64_t kChunksPerRun = 8;
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxStripes = 64;  // up to 1024 groups: the bound serves k <= 1024

struct Workspace {
  std::vector<float> acc;
  std::vector<uint32_t> key;
  std::vector<int32_t> candidate;
  std::vector<uint32_t> candidate_key;
  std::vector<uint32_t> group_max;
  std::vector<int32_t> selected;
  std::vector<float> value;

  void fit(int64_t chunk_size) {
    if (static_cast<int64_t>(acc.size()) >= chunk_size) return;
    acc.resize(chunk_size);
    key.resize(chunk_size);
    candidate.resize(chunk_size + kLanes);  // slack for whole-vector stores
    candidate_key.resize(chunk_size + kLanes);
    selected.resize(chunk_size);
    value.resize(chunk_size);
    group_max.resize(kMaxStripes * kLanes);
  }
};

Workspace& workspace() {
  static thread_local Workspace ws;
  return ws;
}

// Step 1 over one chunk. kResidual: a residual to write; kAdd: acc adds it first.
template <bool kResidual, bool kAdd>
void compensate_chunk(const float* __restrict__ g, float* __restrict__ r, float divisor, int64_t length,
                      int64_t stripes, float* __restrict__ acc, uint32_t* __restrict__ key,
                      uint32_t* __restrict__ group_max) {
  std::fill(group_max, group_max + stripes * kLanes, 0u);
  const int64_t vectors = length / kLanes;
  int64_t stripe = 0;
  for (int64_t v = 0; v < vectors; ++v) {
    uint32_t* maxima = group_max + stripe * kLanes;
    const int64_t base = v * kLanes;
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t j = base + lane;
      float a = g[j] / divisor;
      if constexpr (kAdd) a = a + r[j];
      acc[j] = a;
      const uint32_t bits = float_bits(a);
      const uint32_t k = std::min(bits & 0x7FFFFFFFu, kNanKey);
      key[j] = k;
      if constexpr (kResidual) r[j] = (bits & 0x7F800000u) == 0x7F800000u ? 0.0f : a;
      maxima[lane] = std::max(maxima[lane], k);
    }
    if (++stripe == stripes) stripe = 0;
  }
  for (int64_t j = vectors * kLanes; j < length; ++j) {
    float a = g[j] / divisor;
    if constexpr (kAdd) a = a + r[j];
    acc[j] = a;
    key[j] = magnitude_key(a);
    if constexpr (kResidual) r[j] = std::isfinite(a) ? a : 0.0f;
  }
}

// The largest t whose count {j : keys[j] >= t} is >= k, built bit by bit from the top
// (the count only falls as t grows): with all 31 bits, the k-th largest key. Stopping
// after the top `bits` bits gives a t at or below it. Each step is one vectorised count.
uint32_t kth_largest(const uint32_t* keys, int64_t m, int64_t k, int bits) {
  uint32_t t = 0;
  for (int bit = 30; bit > 30 - bits; --bit) {
    const uint32_t trial = t | (1u << bit);
    int32_t count = 0;  // m <= 65536
    for (int64_t j = 0; j < m; ++j) count += keys[j] >= trial;
    if (count >= k) t = trial;
  }
  return t;
}

// Positions (ascending) and keys of the entries with key >= bar; returns how many.
int64_t collect_at_or_above(const uint32_t* key, int64_t length, uint32_t bar, int32_t* position,
                            uint32_t* found) {
  int64_t m = 0, j = 0;
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
  const __m512i bar16 = _mm512_set1_epi32(static_cast<int32_t>(bar));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= length; j += 16) {
    const __m512i keys = _mm512_loadu_si512(key + j);
    const __mmask16 hits = _mm512_cmpge_epu32_mask(keys, bar16);
    // Compress in registers and store all 16 lanes (the buffers have 16 entries of slack):
    // compress to memory is microcoded on some CPUs (AMD Zen 4), and a branch on `hits`
    // would be mispredicted at about one vector in five.
    const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(j)));
    _mm512_storeu_si512(position + m, _mm512_maskz_compress_epi32(hits, index));
    _mm512_storeu_si512(found + m, _mm512_maskz_compress_epi32(hits, keys));
    m += __builtin_popcount(hits);
  }
#elif SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
  const __m256i bar8 = _mm256_set1_epi32(static_cast<int32_t>(bar));
  for (; j + 8 <= length; j += 8) {
    const __m256i keys = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + j));
    for (uint32_t hits = keys_at_or_above(keys, bar8); hits; hits &= hits - 1) {
      const int64_t p = j + __builtin_ctz(hits);
      position[m] = static_cast<int32_t>(p);
      found[m++] = key[p];
    }
  }
#elif defined(__SSE2__)
  // The default level on x86-64: 4 keys per step, as above (the scalar loop below chains
  // every entry through m, which made it most of the chunked encode at this level). Keys
  // are below 2^31, so SSE2's signed compare orders them as unsigned ones would.
  const __m128i below_bar = _mm_set1_epi32(static_cast<int32_t>(bar) - 1);  // key > this: key >= bar
  for (; j + 4 <= length; j += 4) {
    const __m128i keys = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key + j));
    uint32_t hits = static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(keys, below_bar))));
    for (; hits; hits &= hits - 1) {
      const int64_t p = j + __builtin_ctz(hits);
      position[m] = static_cast<int32_t>(p);
      found[m++] = key[p];
    }
  }
#endif
  for (; j < length; ++j) {  // branch-free: most entries are not taken
    position[m] = static_cast<int32_t>(j);
    found[m] = key[j];
    m += key[j] >= bar;
  }
  return m;
}

// Bits of the group-maximum bound: 16 (exponent and 7 mantissa bits) give a bar at most
// 2^-7 (relative) below the exact k-th maximum, for half the steps.
constexpr int kBoundBits = 16;

// Step 2: the chunk's top k positions, ascending, into ws.selected (ties: lower position).
void select_chunk(Workspace& ws, int64_t length, int64_t k, int64_t stripes, bool bounded) {
  int32_t* selected = ws.selected.data();
  if (k == length) {
    for (int64_t j = 0; j < length; ++j) selected[j] = static_cast<int32_t>(j);
    return;
  }
  // Without a bound every entry is a candidate.
  const uint32_t bar = bounded ? kth_largest(ws.group_max.data(), stripes * kLanes, k, kBoundBits) : 0;
  int32_t* position = ws.candidate.data();
  uint32_t* key = ws.candidate_key.data();
  const int64_t candidates = collect_at_or_above(ws.key.data(), length, bar, position, key);
  const uint32_t kth = kth_largest(key, candidates, k, 31);
  int64_t above = 0;
  for (int64_t c = 0; c < candidates; ++c) above += key[c] > kth;
  int64_t ties = k - above, m = 0;  // keys equal to the k-th: the lowest positions
  for (int64_t c = 0; c < candidates; ++c) {
    const bool take = key[c] > kth || (key[c] == kth && ties > 0);
    ties -= key[c] == kth && take;
    selected[m] = position[c];
    m += take;
  }
  TORCH_INTERNAL_ASSERT(m == k, "chunk_encode: selected ", m, " of k=", k);
}

struct Outputs {
  uint8_t* payload;
  int64_t* indices;
  void* decoded;  // float32 for scaled codecs and fp32, 16-bit wire values for bf16/fp16
  float* residual;
};

// Step 3 for chunk c, whose top k positions are in ws.selected.
void emit_chunk(const ChunkFormat& f, Workspace& ws, int64_t c, int64_t k, const Outputs& out, BitWriter* index_bits,
                BitWriter* value_bits) {
  const int64_t begin = c * f.chunk_size, first = c * f.k_full;
  const int32_t* selected = ws.selected.data();
  float* value = ws.value.data();
  for (int64_t j = 0; j < k; ++j) value[j] = ws.acc[selected[j]];
  float scale = 0.0f;
  if (f.scaled) {
    scale = chunk_scale(f.value_codec, value, k);
    const uint16_t bits = static_cast<uint16_t>(float_bits(scale) >> 16);
    std::memcpy(out.payload + 2 * c, &bits, 2);
  }
  // Index region.
  if (f.index_codec == kIndexInt32) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t index = static_cast<int32_t>(begin + selected[j]);
      std::memcpy(out.payload + f.index_start + 4 * (first + j), &index, 4);
    }
  } else if (f.index_codec == kIndexChunk) {
    for (int64_t j = 0; j < k; ++j) index_bits->put(static_cast<uint32_t>(selected[j]), f.index_bits);
  } else {
    const bool last = c == f.chunks - 1;
    const int r = last ? f.rice_r_last : f.rice_r_full;
    const int64_t chunk_bits = last ? f.rice_bits_last : f.rice_bits_full;
    const uint32_t low_mask = (1u << r) - 1;
    int64_t written = 0, previous = -1;
    for (int64_t j = 0; j < k; ++j) {
      const uint32_t gap = static_cast<uint32_t>(selected[j] - previous - 1);
      const int64_t quotient = gap >> r;
      index_bits->put_ones(quotient);
      index_bits->put(0, 1);
      index_bits->put(gap & low_mask, r);
      written += quotient + 1 + r;
      previous = selected[j];
    }
    index_bits->put_zeros(chunk_bits - written);
  }
  // Value region, decoded values, residual of the sent entries.
  for (int64_t j = 0; j < k; ++j) {
    const float v = value[j];
    uint32_t code;
    float decoded;
    if (f.scaled) {
      code = value_code(f.value_codec, v, scale);
      decoded = decode_code(f.value_codec, code, scale);
      static_cast<float*>(out.decoded)[first + j] = decoded;
    } else {
      code = float_wire_bits(f.value_codec, v);
      decoded = float_wire_value(f.value_codec, code);
      if (f.value_codec == kValueFp32) {
        std::memcpy(static_cast<float*>(out.decoded) + first + j, &code, 4);
      } else {
        static_cast<uint16_t*>(out.decoded)[first + j] = static_cast<uint16_t>(code);
      }
    }
    value_bits->put(code, f.value_bits);
    const int64_t i = begin + selected[j];
    out.indices[first + j] = i;
    // Non-finite acc already left 0 (step 1); a non-finite decoded value (a chunk with an
    // Inf/NaN) sends nothing usable, so the finite acc stays.
    if (out.residual != nullptr && std::isfinite(v)) out.residual[i] = std::isfinite(decoded) ? v - decoded : v;
  }
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
    for (int64_t c = c0; c < c1; ++c) {
      const bool last = c == f.chunks - 1;
      const int64_t length = last ? f.last_length : f.chunk_size, k = last ? f.k_last : f.k_full;
      const int64_t vectors = length / kLanes;
      // About 3k groups, each holding at least one whole vector; fewer than k: no bound.
      const int64_t most = std::min(kMaxStripes, std::max<int64_t>(vectors, 1));
      const int64_t stripes = std::clamp<int64_t>((3 * k + kLanes - 1) / kLanes, 1, most);
      const bool bounded = vectors >= stripes && stripes * kLanes >= k;
      const int64_t begin = c * f.chunk_size;
      compensate_chunk<kResidual, kAdd>(g + begin, kResidual ? out.residual + begin : nullptr, divisor, length,
                                        stripes, ws.acc.data(), ws.key.data(), ws.group_max.data());
      select_chunk(ws, length, k, stripes, bounded);
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
