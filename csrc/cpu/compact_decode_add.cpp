// chunk_decode_add of a layout with a scale_group on CPU (exact top-k on the compact wire):
// decode world_size payloads, each one chunk of the whole bucket, and add them in row
// (rank) order into the bucket: bitwise what ChunkLayout.views + one index_add_ per row give.
//
//   A. Every row's indices into a scratch array [rows x k] (Rice: a row per thread, one code
//      after another, as the codes of one chunk must be read; the fixed-width codecs: blocks
//      of entries in parallel), checked as they are read: inside the bucket. The encoder
//      lists a payload in ascending index order; a fixed-width row that is not (only a payload
//      altered on the way, with wire_checksum=False, can be) is sorted here, stably, with
//      each entry's payload position kept, so that it adds what the reference adds.
//   B. The bucket shared out by runs of 64k entries, as in chunk_decode_add.cpp: a thread
//      finds every row's entries of its run (binary search over the ascending indices) and
//      adds them, row after row; with zero_out the run is summed in a scratch buffer that
//      stays in L2 and written out with streaming stores. Values are decoded as they are
//      added (the scale of entry e is that of group e / scale_group).
//
// Bitwise what ChunkLayout.views + index_add_ give for any payload whose positions lie in the
// bucket, in any order, repeated or not: each entry of the bucket receives its addends in
// row order and, within a row, in payload order. The receivers of one owner exchange decode
// different messages, so a decoder that refused what the reference adds would make one
// rank raise where the others go on (a collective mismatch).
//
// A payload comes from another rank: from a row's first entry that is out of the bucket, or
// (Rice) whose code runs past the row's bits, that entry and the rest of the row are skipped
// and counted, and the caller raises: a corrupt payload never writes outside the bucket.
#include "chunk_codecs.h"
#include "stream_copy.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

constexpr int64_t kRunEntries = 1 << 16;
constexpr int64_t kIndexBlock = 1 << 14;  // step A for the fixed-width codecs: entries per task

struct DecodeWorkspace {
  std::vector<int32_t> index;     // rows x k
  std::vector<int64_t> valid;     // per row: the entries before the first corrupt one
  std::vector<int32_t> position;  // rows x k: a sorted row's payload position of each entry
  std::vector<uint8_t> sorted;    // per row: 1 if its indices were sorted here (position holds)
};

DecodeWorkspace& decode_workspace() {
  static thread_local DecodeWorkspace ws;  // only the calling thread uses it; grows, then reused
  return ws;
}

std::vector<uint64_t>& run_scratch() {
  static thread_local std::vector<uint64_t> buffer;
  return buffer;
}

// Step A, Rice: the row's indices into `index`; returns how many are valid.
int64_t read_rice_row(const ChunkFormat& f, const uint8_t* row, int32_t* index) {
  const uint8_t* region = row + f.index_start;
  const int64_t region_bytes = f.value_start - f.index_start, end = f.rice_bits_full;
  const int r = f.rice_r_full;
  const uint64_t low_mask = (uint64_t{1} << r) - 1;
  int64_t cursor = 0, local = -1;
  for (int64_t j = 0; j < f.selected; ++j) {
    // The unary part: ones up to the next zero bit; one 57-bit window holds the whole code
    // unless the quotient is large (as chunk_decode_add.cpp).
    uint64_t window = peek_bits(region, region_bytes, cursor);
    int64_t quotient = 0;
    int ones = __builtin_ctzll(~window | (uint64_t{1} << 57));
    while (ones == 57 && cursor + 57 < end) {
      quotient += 57;
      cursor += 57;
      window = peek_bits(region, region_bytes, cursor);
      ones = __builtin_ctzll(~window | (uint64_t{1} << 57));
    }
    quotient += ones;
    cursor += ones + 1;
    const int64_t low =
        ones + 1 + r <= 57 ? (window >> (ones + 1)) & low_mask : read_field(region, region_bytes, cursor, r);
    cursor += r;
    local += ((quotient << r) | low) + 1;
    if (cursor > end || local >= f.numel) return j;
    index[j] = static_cast<int32_t>(local);
  }
  return f.selected;
}

struct BlockRead {
  int64_t first_invalid;  // e1 if none
  bool ascending;         // every valid entry of the block above the one before it
};

// Step A, int32 and chunk codecs: entries [e0, e1) of the row into `index`.
BlockRead read_fixed_width(const ChunkFormat& f, const uint8_t* row, int64_t e0, int64_t e1, int32_t* index) {
  const uint8_t* region = row + f.index_start;
  const int64_t region_bytes = f.value_start - f.index_start;
  auto read = [&](int64_t e) -> int64_t {
    if (f.index_codec == kIndexInt32) {
      int32_t i;
      std::memcpy(&i, region + 4 * e, 4);
      return i;
    }
    return read_field(region, region_bytes, e * f.index_bits, f.index_bits);
  };
  int64_t previous = e0 > 0 ? read(e0 - 1) : -1;
  bool ascending = true;
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t i = read(e);
    if (i < 0 || i >= f.numel) return {e, ascending};
    ascending = ascending && i > previous;
    index[e] = static_cast<int32_t>(i);
    previous = i;
  }
  return {e1, ascending};
}

// Step A, a row that is not in ascending order: its valid entries sorted by index, stably
// (a repeated index keeps its payload order), each entry's payload position in `position`.
void sort_row(int32_t* index, int32_t* position, int64_t valid) {
  for (int64_t e = 0; e < valid; ++e) position[e] = static_cast<int32_t>(e);
  std::stable_sort(position, position + valid, [&](int32_t a, int32_t b) { return index[a] < index[b]; });
  std::vector<int32_t> sorted(valid);
  for (int64_t e = 0; e < valid; ++e) sorted[e] = index[position[e]];
  std::copy(sorted.begin(), sorted.end(), index);
}

template <typename T>
int64_t decode_add_impl(const at::Tensor& gathered, const ChunkFormat& f, int64_t rows, int64_t row_stride,
                        const at::Tensor& out, bool zero_out) {
  const uint8_t* base = gathered.const_data_ptr<uint8_t>();
  T* dst = out.mutable_data_ptr<T>();
  const int64_t k = f.selected;
  DecodeWorkspace& ws = decode_workspace();
  ws.index.resize(rows * k);
  ws.valid.assign(rows, k);
  ws.sorted.assign(rows, 0);
  // Step A.
  if (f.index_codec == kIndexRice) {
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        ws.valid[row] = read_rice_row(f, base + row * row_stride, ws.index.data() + row * k);
      }
    });
  } else {
    const int64_t blocks = (k + kIndexBlock - 1) / kIndexBlock;
    std::vector<BlockRead> reads(rows * blocks);
    at::parallel_for(0, rows * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t row = task / blocks, e0 = task % blocks * kIndexBlock;
        reads[task] = read_fixed_width(f, base + row * row_stride, e0, std::min(k, e0 + kIndexBlock),
                                       ws.index.data() + row * k);
      }
    });
    for (int64_t row = 0; row < rows; ++row) {
      bool ascending = true;
      for (int64_t b = 0; b < blocks && ws.valid[row] == k; ++b) {
        const BlockRead& read = reads[row * blocks + b];
        ascending = ascending && read.ascending;
        if (read.first_invalid < std::min(k, (b + 1) * kIndexBlock)) ws.valid[row] = read.first_invalid;
      }
      if (!ascending) {
        ws.position.resize(rows * k);
        sort_row(ws.index.data() + row * k, ws.position.data() + row * k, ws.valid[row]);
        ws.sorted[row] = 1;
      }
    }
  }
  int64_t corrupt = 0;
  for (int64_t row = 0; row < rows; ++row) corrupt += k - ws.valid[row];

  // Step B.
  const int32_t vb = f.value_bits;
  const int64_t value_bytes = f.value_end - f.value_start;
  auto value_at = [&](const uint8_t* row, int64_t e) {
    const uint8_t* region = row + f.value_start;
    uint32_t code;
    if (vb == 32) {
      std::memcpy(&code, region + 4 * e, 4);
    } else if (vb == 16) {
      uint16_t half;
      std::memcpy(&half, region + 2 * e, 2);
      code = half;
    } else if (vb == 8) {
      code = region[e];
    } else {
      code = read_field(region, value_bytes, e * vb, vb);
    }
    return f.scaled ? decode_code(f.value_codec, code, scale_from_bytes(row, e / f.scale_group))
                    : float_wire_value(f.value_codec, code);
  };
  const int64_t runs = (f.numel + kRunEntries - 1) / kRunEntries;
  at::parallel_for(0, runs, 1, [&](int64_t first_run, int64_t last_run) {
    std::vector<uint64_t>& buffer = run_scratch();
    if (zero_out) buffer.resize((kRunEntries * sizeof(T) + 7) / 8);
    for (int64_t run = first_run; run < last_run; ++run) {
      const int64_t lo = run * kRunEntries, hi = std::min(lo + kRunEntries, f.numel);
      // The run's sum: in the scratch buffer (entry lo at its start), or in place.
      T* sum = zero_out ? reinterpret_cast<T*>(buffer.data()) : dst + lo;
      if (zero_out) std::memset(static_cast<void*>(sum), 0, (hi - lo) * sizeof(T));  // all-zero bits: +0.0
      for (int64_t row = 0; row < rows; ++row) {
        const uint8_t* payload = base + row * row_stride;
        const int32_t* index = ws.index.data() + row * k;
        const int32_t* end = index + ws.valid[row];
        const int32_t* position = ws.sorted[row] ? ws.position.data() + row * k : nullptr;
        for (const int32_t* at = std::lower_bound(index, end, static_cast<int32_t>(lo)); at < end && *at < hi; ++at) {
          add_to(sum, *at - lo, value_at(payload, position ? position[at - index] : at - index));
        }
      }
      if (zero_out) stream_copy(dst + lo, sum, (hi - lo) * sizeof(T));
    }
  });
  return corrupt;
}

}  // namespace

// Arguments checked by the caller (dispatch/cpu_ops.cpp), which also raises for the
// corrupt entries counted here; f.scale_group > 0.
int64_t compact_decode_add(const at::Tensor& gathered, const ChunkFormat& f, int64_t rows, int64_t row_stride,
                           const at::Tensor& out, bool zero_out) {
  return SPARSECOMM_DISPATCH_FLOATING(out.scalar_type(), "chunk_decode_add", T, [&] {
    return decode_add_impl<T>(gathered, f, rows, row_stride, out, zero_out);
  });
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
