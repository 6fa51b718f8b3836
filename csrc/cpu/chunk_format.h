// The byte layout of a chunked-selection payload (selector="chunk"), as numbers: what
// sparsecomm/compress/chunk_layout.py computes from (numel, chunk_size, density, codecs).
// Computed once per call by the dispatch (dispatch/chunk_format.cpp, baseline code) and
// handed to the kernels of the chosen level, which only read it: a plain aggregate, so no
// code of it is compiled per level.
#pragma once

#include <cstdint>

namespace sparsecomm {

// Codec ids: the position of the name in sparsecomm.compress.index_codecs.INDEX_CODECS and
// value_codecs.VALUE_CODECS.
enum ChunkIndexCodec : int32_t { kIndexInt32 = 0, kIndexChunk = 1, kIndexRice = 2 };
enum ChunkValueCodec : int32_t {
  kValueFp32 = 0, kValueBf16 = 1, kValueFp16 = 2, kValueFp8 = 3,
  kValueInt8 = 4, kValueInt4 = 5, kValueInt2 = 6, kValueSign = 7,
};
// The names, by id: sparsecomm::chunk_codecs() returns them, and sparsecomm/ops/native.py
// checks them against the Python tables when it loads the extension (a codec added on one
// side only would otherwise code every payload with the wrong codec).
inline constexpr const char* kIndexCodecNames[] = {"int32", "chunk", "rice"};
inline constexpr const char* kValueCodecNames[] = {"fp32", "bf16", "fp16", "fp8", "int8", "int4", "int2", "sign"};
static_assert(sizeof(kIndexCodecNames) / sizeof(kIndexCodecNames[0]) == kIndexRice + 1);
static_assert(sizeof(kValueCodecNames) / sizeof(kValueCodecNames[0]) == kValueSign + 1);

// Chunks of the chunked selection: chunk-local positions fit 16 bits. A layout with a
// scale_group (exact top-k on the compact wire) is one chunk of the whole bucket.
constexpr int64_t kMaxChunkSize = 65536;

struct ChunkFormat {
  int64_t numel, chunk_size, chunks, last_length, k_full, k_last, selected;
  // 0: a scale per chunk; else a scale per scale_group consecutive payload entries (then
  // the bucket is one chunk: chunk_size == numel, k_full == k_last == selected).
  int64_t scale_group;
  int64_t scale_groups;  // scales a scaled codec writes: chunks, or ceil(selected / scale_group)
  int32_t index_codec, value_codec;
  int32_t index_bits;  // the chunk codec's field width
  int32_t value_bits;
  bool scaled;         // a bf16 scale per scale group precedes the index region
  int32_t rice_r_full, rice_r_last;        // Rice parameters of a full and of the last chunk
  int64_t rice_bits_full, rice_bits_last;  // bits every such chunk takes (zero-padded)
  // Byte offsets: [scales | index region | value region | zero pad to 8].
  int64_t index_start, value_start, value_end, nbytes;
};

// Checks the arguments (TORCH_CHECK) and returns the layout.
ChunkFormat chunk_format(const char* op, int64_t numel, int64_t chunk_size, int64_t k_full, int64_t k_last,
                         int64_t index_codec, int64_t value_codec, int64_t scale_group);

}  // namespace sparsecomm
