// The argument checks of the chunk operators, shared by the CPU and CUDA implementations
// so that both refuse the same calls with the same messages (host code, built once).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "../chunk_format.h"

namespace sparsecomm {

// chunk_encode(grad, residual, divisor, add_residual, layout, payload): grad a contiguous
// 1-D float32 tensor, residual (if any) matching it without overlapping it, payload exactly
// the format's bytes, all on grad's device; divisor > 0. Returns the format.
ChunkFormat check_chunk_encode(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double divisor,
                               bool add_residual, int64_t chunk_size, int64_t k_full, int64_t k_last,
                               int64_t index_codec, int64_t value_codec, int64_t scale_group,
                               const at::Tensor& payload);

// chunk_decode_add(gathered, layout, out): out a contiguous 1-D tensor, gathered whole
// payloads of the format (uint8) on out's device: back to back (1-D), or one per row of a
// 2-D tensor whose rows may lie farther apart (sealed payloads). Returns the format.
ChunkFormat check_chunk_decode_add(const at::Tensor& gathered, int64_t chunk_size, int64_t k_full, int64_t k_last,
                                   int64_t index_codec, int64_t value_codec, int64_t scale_group,
                                   const at::Tensor& out);

// The payloads of a checked gathered: how many, and the bytes from one's start to the next's.
struct PayloadRows {
  int64_t rows, stride;
};
PayloadRows payload_rows(const at::Tensor& gathered, const ChunkFormat& f);

// The dtype of the decoded values chunk_encode returns: the float codec's, float32 otherwise.
at::ScalarType chunk_decoded_dtype(int64_t value_codec);

}  // namespace sparsecomm
