// The chunk operators' argument checks (chunk_checks.h).
#include "chunk_checks.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

namespace sparsecomm {
namespace {

// [first byte, one past the last) of a contiguous tensor's storage.
std::pair<uintptr_t, uintptr_t> byte_extent(const at::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + static_cast<uintptr_t>(t.numel() * t.element_size())};
}

}  // namespace

ChunkFormat check_chunk_encode(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double divisor,
                               bool add_residual, int64_t chunk_size, int64_t k_full, int64_t k_last,
                               int64_t index_codec, int64_t value_codec, int64_t scale_group,
                               const at::Tensor& payload) {
  TORCH_CHECK(grad.dim() == 1 && grad.is_contiguous() && grad.scalar_type() == at::kFloat,
              "chunk_encode: grad must be a contiguous 1-D float32 tensor, got ", grad.scalar_type(), " ",
              grad.sizes());
  const ChunkFormat f = chunk_format("chunk_encode", grad.numel(), chunk_size, k_full, k_last, index_codec,
                                     value_codec, scale_group);
  TORCH_CHECK(!add_residual || residual.has_value(), "chunk_encode: add_residual=True needs a residual");
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.dim() == 1 && r.is_contiguous() && r.numel() == grad.numel() && r.scalar_type() == grad.scalar_type(),
                "chunk_encode: residual must be a contiguous 1-D tensor matching grad (", grad.numel(), " x ",
                grad.scalar_type(), ")");
    TORCH_CHECK(r.device() == grad.device(), "chunk_encode: residual must be on grad's device ", grad.device());
    const auto er = byte_extent(r), eg = byte_extent(grad);
    TORCH_CHECK(r.data_ptr() != grad.data_ptr() && !(er.first < eg.second && eg.first < er.second),
                "chunk_encode: residual may not alias grad");
  }
  TORCH_CHECK(payload.dim() == 1 && payload.is_contiguous() && payload.scalar_type() == at::kByte &&
                  payload.numel() == f.nbytes,
              "chunk_encode: payload must be a contiguous 1-D uint8 tensor of ", f.nbytes, " bytes, got ",
              payload.scalar_type(), " ", payload.sizes());
  TORCH_CHECK(payload.device() == grad.device(), "chunk_encode: payload must be on grad's device ", grad.device());
  TORCH_CHECK(divisor > 0, "chunk_encode: divisor must be > 0, got ", divisor);
  return f;
}

ChunkFormat check_chunk_decode_add(const at::Tensor& gathered, int64_t chunk_size, int64_t k_full, int64_t k_last,
                                   int64_t index_codec, int64_t value_codec, int64_t scale_group,
                                   const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), "chunk_decode_add: out must be a contiguous 1-D tensor");
  const ChunkFormat f = chunk_format("chunk_decode_add", out.numel(), chunk_size, k_full, k_last, index_codec,
                                     value_codec, scale_group);
  // Back to back (1-D), or one payload per row of a 2-D tensor whose rows may lie farther
  // apart (sealed payloads: sparsecomm/compress/payload_seal.py).
  const bool back_to_back = gathered.dim() == 1 && gathered.is_contiguous() && gathered.numel() % f.nbytes == 0;
  const bool strided_rows = gathered.dim() == 2 && gathered.size(1) == f.nbytes && gathered.stride(1) == 1 &&
                            (gathered.size(0) <= 1 || gathered.stride(0) >= f.nbytes);
  TORCH_CHECK(gathered.scalar_type() == at::kByte && (back_to_back || strided_rows),
              "chunk_decode_add: gathered must be contiguous uint8 of world_size x ", f.nbytes,
              " bytes, or uint8 [world_size, ", f.nbytes, "] rows, got ", gathered.scalar_type(), " ",
              gathered.sizes(), " (strides ", gathered.strides(), ")");
  TORCH_CHECK(gathered.device() == out.device(), "chunk_decode_add: gathered and out must be on one device");
  return f;
}

PayloadRows payload_rows(const at::Tensor& gathered, const ChunkFormat& f) {
  if (gathered.dim() == 2) return {gathered.size(0), gathered.stride(0)};
  return {gathered.numel() / f.nbytes, f.nbytes};
}

at::ScalarType chunk_decoded_dtype(int64_t value_codec) {
  return value_codec == kValueBf16 ? at::kBFloat16 : value_codec == kValueFp16 ? at::kHalf : at::kFloat;
}

}  // namespace sparsecomm
