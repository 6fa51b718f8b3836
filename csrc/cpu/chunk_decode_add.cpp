// Decode world_size chunked payloads and add them into the dense bucket on CPU.
//
// Chunks decode independently (every chunk's scale, index bits and value bits start at a
// position known from the geometry), so the bucket is shared out by runs of chunks of
// about 64k entries, and every row's entries of a run are added, row after row, into it.
// Each element receives its adds in row (rank) order onto zeros, bitwise what
// ChunkLayout.views + one index_add_ per row give. No two threads write the same element.
//
// With zero_out the sum of a run is formed in a per-thread scratch buffer that stays in L2
// and then written to the bucket with streaming stores: each bucket byte is written once
// and never read (zeroing the bucket in place reads every line first, then the scattered
// adds wait on it: twice the memory traffic).
//
// A payload comes from another rank: an entry that decodes to a position outside its
// chunk (or a Rice code running past its chunk) is skipped and counted, and the caller
// raises, so a corrupt payload never writes outside the bucket.
#include "chunk_codecs.h"
#include "stream_copy.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

constexpr int64_t kRunEntries = 1 << 16;

// Adds chunk c of one payload row into sum, which holds the bucket from entry `origin` on;
// returns the entries found corrupt.
template <typename T>
int64_t add_chunk(const ChunkFormat& f, const uint8_t* row, int64_t c, T* sum, int64_t origin) {
  const bool last = c == f.chunks - 1;
  const int64_t length = last ? f.last_length : f.chunk_size, k = last ? f.k_last : f.k_full;
  const int64_t begin = c * f.chunk_size, first = c * f.k_full;
  T* dst = sum + (begin - origin);  // the chunk's first entry
  const uint8_t* index_region = row + f.index_start;
  const uint8_t* value_region = row + f.value_start;
  const int64_t index_bytes = f.value_start - f.index_start, value_bytes = f.value_end - f.value_start;
  const float scale = f.scaled ? scale_from_bytes(row, c) : 0.0f;
  const int32_t vb = f.value_bits;
  auto value_at = [&](int64_t j) {
    const int64_t e = first + j;
    uint32_t code;
    if (vb == 32) {
      std::memcpy(&code, value_region + 4 * e, 4);
    } else if (vb == 16) {
      uint16_t half;
      std::memcpy(&half, value_region + 2 * e, 2);
      code = half;
    } else if (vb == 8) {
      code = value_region[e];
    } else {
      code = read_field(value_region, value_bytes, e * vb, vb);
    }
    return f.scaled ? decode_code(f.value_codec, code, scale) : float_wire_value(f.value_codec, code);
  };
  int64_t corrupt = 0;
  if (f.index_codec == kIndexInt32) {
    for (int64_t j = 0; j < k; ++j) {
      int32_t index;
      std::memcpy(&index, index_region + 4 * (first + j), 4);
      const int64_t local = int64_t{index} - begin;
      if (local < 0 || local >= length) {
        ++corrupt;
        continue;
      }
      add_to(dst, local, value_at(j));
    }
  } else if (f.index_codec == kIndexChunk) {
    const int32_t bits = f.index_bits;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t local = read_field(index_region, index_bytes, (first + j) * bits, bits);
      if (local >= length) {
        ++corrupt;
        continue;
      }
      add_to(dst, local, value_at(j));
    }
  } else {
    const int r = last ? f.rice_r_last : f.rice_r_full;
    int64_t cursor = c * f.rice_bits_full;
    const int64_t end = cursor + (last ? f.rice_bits_last : f.rice_bits_full);
    int64_t local = -1;
    const uint64_t low_mask = (uint64_t{1} << r) - 1;
    for (int64_t j = 0; j < k; ++j) {
      // The unary part: ones up to the next zero bit; one 57-bit window holds the whole
      // code unless the quotient is large.
      uint64_t window = peek_bits(index_region, index_bytes, cursor);
      int64_t quotient = 0;
      int ones = __builtin_ctzll(~window | (uint64_t{1} << 57));
      while (ones == 57 && cursor + 57 < end) {
        quotient += 57;
        cursor += 57;
        window = peek_bits(index_region, index_bytes, cursor);
        ones = __builtin_ctzll(~window | (uint64_t{1} << 57));
      }
      quotient += ones;
      cursor += ones + 1;  // the ones and the zero
      const int64_t low = ones + 1 + r <= 57 ? (window >> (ones + 1)) & low_mask
                                             : read_field(index_region, index_bytes, cursor, r);
      cursor += r;
      local += ((quotient << r) | low) + 1;
      if (cursor > end || local >= length) {
        corrupt += k - j;
        break;
      }
      add_to(dst, local, value_at(j));
    }
  }
  return corrupt;
}

std::vector<uint64_t>& scratch() {
  static thread_local std::vector<uint64_t> buffer;
  return buffer;
}

template <typename T>
int64_t decode_add_impl(const at::Tensor& gathered, const ChunkFormat& f, int64_t rows, int64_t row_stride,
                        const at::Tensor& out, bool zero_out) {
  const uint8_t* base = gathered.const_data_ptr<uint8_t>();
  T* dst = out.mutable_data_ptr<T>();
  const int64_t chunks_per_run = std::max<int64_t>(1, kRunEntries / f.chunk_size);
  const int64_t runs = (f.chunks + chunks_per_run - 1) / chunks_per_run;
  std::vector<int64_t> corrupt(runs, 0);
  at::parallel_for(0, runs, 1, [&](int64_t first_run, int64_t last_run) {
    std::vector<uint64_t>& buffer = scratch();
    if (zero_out) buffer.resize((chunks_per_run * f.chunk_size * sizeof(T) + 7) / 8);
    for (int64_t run = first_run; run < last_run; ++run) {
      const int64_t c0 = run * chunks_per_run, c1 = std::min(c0 + chunks_per_run, f.chunks);
      const int64_t lo = c0 * f.chunk_size, hi = std::min(c1 * f.chunk_size, f.numel);
      // The run's sum: in the scratch buffer (entry lo at its start), or in place.
      T* sum = zero_out ? reinterpret_cast<T*>(buffer.data()) : dst + lo;
      if (zero_out) std::memset(static_cast<void*>(sum), 0, (hi - lo) * sizeof(T));  // all-zero bits: +0.0
      for (int64_t row = 0; row < rows; ++row) {
        for (int64_t c = c0; c < c1; ++c) corrupt[run] += add_chunk<T>(f, base + row * row_stride, c, sum, lo);
      }
      if (zero_out) stream_copy(dst + lo, sum, (hi - lo) * sizeof(T));
    }
  });
  int64_t total = 0;
  for (const int64_t count : corrupt) total += count;
  return total;
}

}  // namespace

// Arguments checked by the caller (dispatch/cpu_ops.cpp), which also raises for the
// corrupt entries counted here.
int64_t chunk_decode_add(const at::Tensor& gathered, const ChunkFormat& f, int64_t rows, int64_t row_stride,
                         const at::Tensor& out, bool zero_out) {
  return SPARSECOMM_DISPATCH_FLOATING(out.scalar_type(), "chunk_decode_add", T, [&] {
    return decode_add_impl<T>(gathered, f, rows, row_stride, out, zero_out);
  });
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
