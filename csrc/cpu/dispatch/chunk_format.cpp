// The payload layout of a chunked selection (chunk_format.h), computed as
// sparsecomm/compress/chunk_layout.py does.
#include "../chunk_format.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

namespace sparsecomm {
namespace {

// index_codecs.MAX_RICE_PARAMETER: gaps of up to 2^31 (one chunk the size of the largest
// bucket). Chunks of at most 65536 entries never need more than 16.
constexpr int32_t kMaxRiceParameter = 30;
constexpr int64_t kAlignment = 8;  // sparsecomm.compress.layout.ALIGNMENT

int64_t packed_nbytes(int64_t count, int64_t bits) { return (count * bits + 7) / 8; }

int64_t rice_bound(int64_t length, int64_t k, int32_t r) { return k * (r + 1) + ((length - k) >> r); }

// The parameter minimising the worst case; the smaller one on equal bounds.
int32_t rice_parameter(int64_t length, int64_t k) {
  int32_t best = 0;
  for (int32_t r = 1; r <= kMaxRiceParameter; ++r) {
    if (rice_bound(length, k, r) < rice_bound(length, k, best)) best = r;
  }
  return best;
}

int32_t value_bits(int32_t codec) {
  switch (codec) {
    case kValueFp32: return 32;
    case kValueBf16: case kValueFp16: return 16;
    case kValueFp8: case kValueInt8: return 8;
    case kValueInt4: return 4;
    case kValueInt2: return 2;
    default: return 1;  // sign
  }
}

// The codec names by id (chunk_format.h), for sparsecomm.ops.native's check at load.
std::tuple<std::vector<std::string>, std::vector<std::string>> chunk_codecs_op() {
  return {std::vector<std::string>(std::begin(kIndexCodecNames), std::end(kIndexCodecNames)),
          std::vector<std::string>(std::begin(kValueCodecNames), std::end(kValueCodecNames))};
}

}  // namespace

// No tensor arguments: CompositeExplicitAutograd serves calls without a dispatch key.
TORCH_LIBRARY_IMPL(sparsecomm, CompositeExplicitAutograd, m) { m.impl("chunk_codecs", &chunk_codecs_op); }

ChunkFormat chunk_format(const char* op, int64_t numel, int64_t chunk_size, int64_t k_full, int64_t k_last,
                         int64_t index_codec, int64_t value_codec, int64_t scale_group) {
  TORCH_CHECK(numel >= 1 && numel <= INT32_MAX, op, ": the bucket must hold 1 to 2^31 - 1 entries, got ", numel);
  TORCH_CHECK(scale_group >= 0, op, ": scale_group must be >= 0, got ", scale_group);
  if (scale_group > 0) {  // exact top-k on the compact wire: the whole bucket is one chunk
    TORCH_CHECK(chunk_size == numel, op, ": a layout with a scale_group (", scale_group,
                ") must be one chunk of the whole bucket (chunk_size == numel == ", numel, "), got chunk_size ",
                chunk_size);
  } else {
    TORCH_CHECK(chunk_size >= 2 && chunk_size <= kMaxChunkSize, op, ": chunk_size must be in [2, ", kMaxChunkSize,
                "], got ", chunk_size);
  }
  TORCH_CHECK(index_codec >= kIndexInt32 && index_codec <= kIndexRice, op,
              ": index_codec must be 0 (int32), 1 (chunk) or 2 (rice), got ", index_codec);
  TORCH_CHECK(value_codec >= kValueFp32 && value_codec <= kValueSign, op,
              ": value_codec must be in [0, 7] (fp32, bf16, fp16, fp8, int8, int4, int2, sign), got ", value_codec);
  ChunkFormat f{};
  f.numel = numel;
  f.chunk_size = chunk_size;
  f.chunks = (numel + chunk_size - 1) / chunk_size;
  f.last_length = numel - (f.chunks - 1) * chunk_size;
  TORCH_CHECK(k_full >= 1 && k_full <= chunk_size, op, ": k_full must be in [1, ", chunk_size, "], got ", k_full);
  TORCH_CHECK(k_last >= 1 && k_last <= std::min(f.last_length, k_full), op, ": k_last must be in [1, ",
              std::min(f.last_length, k_full), "], got ", k_last);
  f.k_full = k_full;
  f.k_last = k_last;
  f.selected = (f.chunks - 1) * k_full + k_last;
  f.scale_group = scale_group;
  f.scale_groups = scale_group > 0 ? (f.selected + scale_group - 1) / scale_group : f.chunks;
  f.index_codec = static_cast<int32_t>(index_codec);
  f.value_codec = static_cast<int32_t>(value_codec);
  int32_t bits = 1;
  while ((int64_t{1} << bits) < chunk_size) ++bits;
  f.index_bits = bits;
  f.value_bits = value_bits(f.value_codec);
  f.scaled = f.value_codec >= kValueFp8;
  f.rice_r_full = rice_parameter(chunk_size, k_full);
  f.rice_r_last = rice_parameter(f.last_length, k_last);
  f.rice_bits_full = rice_bound(chunk_size, k_full, f.rice_r_full);
  f.rice_bits_last = rice_bound(f.last_length, k_last, f.rice_r_last);
  int64_t index_bytes = 0;
  switch (f.index_codec) {
    case kIndexInt32: index_bytes = 4 * f.selected; break;
    case kIndexChunk: index_bytes = packed_nbytes(f.selected, f.index_bits); break;
    default: index_bytes = packed_nbytes((f.chunks - 1) * f.rice_bits_full + f.rice_bits_last, 1);
  }
  f.index_start = f.scaled ? 2 * f.scale_groups : 0;
  f.value_start = f.index_start + index_bytes;
  f.value_end = f.value_start + packed_nbytes(f.selected, f.value_bits);
  f.nbytes = (f.value_end + kAlignment - 1) / kAlignment * kAlignment;
  return f;
}

}  // namespace sparsecomm
