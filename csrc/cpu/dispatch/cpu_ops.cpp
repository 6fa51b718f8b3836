// The CPU operators (schema: csrc/sparsecomm_ops.cpp, contract: csrc/README.md). Each checks
// its arguments ("Errors": raised before any work, the same at every level), then runs the
// kernel of the CPU level this process uses (cpu_level.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "../kernels.h"
#include "chunk_checks.h"
#include "cpu_level.h"

namespace sparsecomm {
namespace {

const CpuKernels& kernels() {
  static const CpuKernels chosen = [] {  // a throw (bad SPARSECOMM_CPU_CAPABILITY) leaves it unset
    switch (cpu_level()) {
#if SPARSECOMM_CPU_X86_LEVELS
      case CpuLevel::avx512:
        return cpu_avx512::kernels();
      case CpuLevel::avx2:
        return cpu_avx2::kernels();
#endif
      default:
        return cpu_default::kernels();
    }
  }();
  return chosen;
}

// Checks shared by the pack operators.
void check_pack_arguments(const char* op, const at::Tensor& grad, const c10::optional<at::Tensor>& residual,
                          bool add_residual, const at::Tensor& indices_out, const at::Tensor& values_out,
                          double divisor, int64_t index_offset) {
  TORCH_CHECK(grad.dim() == 1 && grad.is_contiguous(), op, ": grad must be a contiguous 1-D tensor");
  TORCH_CHECK(grad.numel() <= std::numeric_limits<int32_t>::max(), op,
              ": grad has ", grad.numel(), " elements; int32 indices allow at most 2^31 - 1");
  TORCH_CHECK(indices_out.dim() == 1 && indices_out.is_contiguous() && indices_out.scalar_type() == at::kInt, op,
              ": indices_out must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(values_out.dim() == 1 && values_out.is_contiguous(), op, ": values_out must be a contiguous 1-D tensor");
  TORCH_CHECK(values_out.numel() >= indices_out.numel(), op, ": values_out holds ", values_out.numel(),
              " entries, indices_out ", indices_out.numel());
  TORCH_CHECK(!add_residual || residual.has_value(), op, ": add_residual=True needs a residual");
  for (const at::Tensor* t : {&indices_out, &values_out}) {
    TORCH_CHECK(t->device() == grad.device(), op, ": outputs must be on grad's device ", grad.device());
  }
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.dim() == 1 && r.is_contiguous() && r.numel() == grad.numel() && r.scalar_type() == grad.scalar_type(),
                op, ": residual must be a contiguous 1-D tensor matching grad (", grad.numel(), " x ",
                grad.scalar_type(), ")");
    TORCH_CHECK(r.device() == grad.device(), op, ": residual must be on grad's device ", grad.device());
    TORCH_CHECK(r.data_ptr() != grad.data_ptr(), op, ": residual may not alias grad");
  }
  TORCH_CHECK(divisor > 0, op, ": divisor must be > 0, got ", divisor);
  TORCH_CHECK(index_offset >= 0 && index_offset + grad.numel() <= std::numeric_limits<int32_t>::max(), op,
              ": index_offset + n must fit in int32, got ", index_offset);
}

void ef_topk_pack_cpu(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, double divisor,
                      bool add_residual, int64_t k, const at::Tensor& indices_out, const at::Tensor& values_out,
                      int64_t index_offset) {
  check_pack_arguments("ef_topk_pack", grad, residual, add_residual, indices_out, values_out, divisor, index_offset);
  TORCH_CHECK(k >= 1 && k <= grad.numel(), "ef_topk_pack: k must be in [1, ", grad.numel(), "], got ", k);
  TORCH_CHECK(indices_out.numel() >= k, "ef_topk_pack: indices_out holds ", indices_out.numel(), " < k=", k);
  kernels().ef_topk_pack(grad, residual, static_cast<float>(divisor), add_residual, k, indices_out, values_out,
                         index_offset);
}

at::Tensor ef_threshold_pack_cpu(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, double divisor,
                                 bool add_residual, double threshold, const at::Tensor& indices_out,
                                 const at::Tensor& values_out, int64_t index_offset) {
  check_pack_arguments("ef_threshold_pack", grad, residual, add_residual, indices_out, values_out, divisor,
                       index_offset);
  const int64_t sent = kernels().ef_threshold_pack(grad, residual, static_cast<float>(divisor), add_residual,
                                                   static_cast<float>(threshold), indices_out, values_out,
                                                   index_offset);
  return at::scalar_tensor(sent, grad.options().dtype(at::kLong));
}

void unpack_add_cpu(const at::Tensor& indices, const at::Tensor& values, const at::Tensor& out, bool zero_out) {
  TORCH_CHECK(indices.dim() == 2 && values.dim() == 2 && indices.sizes() == values.sizes(),
              "unpack_add: indices and values must both be [world_size, k], got ", indices.sizes(), " and ",
              values.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kInt, "unpack_add: indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK(indices.size(1) <= 1 || (indices.stride(1) == 1 && values.stride(1) == 1),
              "unpack_add: each row of indices and values must be contiguous");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), "unpack_add: out must be a contiguous 1-D tensor");
  TORCH_CHECK(indices.device() == out.device() && values.device() == out.device(),
              "unpack_add: indices, values and out must be on one device");
  const int64_t out_of_range = kernels().unpack_add(indices, values, out, zero_out);
  // Checked while scanning (a payload comes from another rank: a corrupt one must not
  // write outside the bucket); such entries were skipped.
  TORCH_CHECK(out_of_range == 0, "unpack_add: ", out_of_range, " indices outside [0, ", out.numel(),
              "): corrupt payload");
}

// Native for float32 gradients; sparsecomm/ops/dispatch.py sends other dtypes to the
// reference.
std::tuple<at::Tensor, at::Tensor> chunk_encode_cpu(const at::Tensor& grad, const c10::optional<at::Tensor>& residual,
                                                    double divisor, bool add_residual, int64_t chunk_size,
                                                    int64_t k_full, int64_t k_last, int64_t index_codec,
                                                    int64_t value_codec, int64_t scale_group,
                                                    const at::Tensor& payload) {
  const ChunkFormat f = check_chunk_encode(grad, residual, divisor, add_residual, chunk_size, k_full, k_last,
                                           index_codec, value_codec, scale_group, payload);
  const at::ScalarType decoded_dtype = chunk_decoded_dtype(value_codec);
  at::Tensor indices = at::empty({f.selected}, grad.options().dtype(at::kLong));
  at::Tensor decoded = at::empty({f.selected}, grad.options().dtype(decoded_dtype));
  // A scale_group: exact top-k on the compact wire (one chunk), compact_encode.cpp.
  ChunkEncodeKernel* kernel = f.scale_group > 0 ? kernels().compact_encode : kernels().chunk_encode;
  kernel(grad, residual, static_cast<float>(divisor), add_residual, f, payload, indices, decoded);
  return {indices, decoded};
}

void chunk_decode_add_cpu(const at::Tensor& gathered, int64_t chunk_size, int64_t k_full, int64_t k_last,
                          int64_t index_codec, int64_t value_codec, int64_t scale_group, const at::Tensor& out,
                          bool zero_out) {
  const ChunkFormat f = check_chunk_decode_add(gathered, chunk_size, k_full, k_last, index_codec, value_codec,
                                               scale_group, out);
  const PayloadRows payloads = payload_rows(gathered, f);
  ChunkDecodeAddKernel* kernel = f.scale_group > 0 ? kernels().compact_decode_add : kernels().chunk_decode_add;
  const int64_t corrupt = kernel(gathered, f, payloads.rows, payloads.stride, out, zero_out);
  TORCH_CHECK(corrupt == 0, "chunk_decode_add: ", corrupt,
              f.scale_group > 0 ? " entries decode to positions outside the bucket: corrupt payload"
                                : " entries decode to positions outside their chunk: corrupt payload");
}

at::Tensor crc32c_cpu(const at::Tensor& data) {
  TORCH_CHECK(data.scalar_type() == at::kByte && (data.dim() == 1 || data.dim() == 2),
              "crc32c: data must be a 1-D or 2-D uint8 tensor, got ", data.scalar_type(), " ", data.sizes());
  const at::Tensor rows = data.dim() == 1 ? data.reshape({1, data.numel()}) : data;
  TORCH_CHECK(rows.size(1) <= 1 || rows.stride(1) == 1, "crc32c: each row of data must be contiguous");
  TORCH_CHECK(rows.size(0) <= 1 || rows.stride(0) >= rows.size(1), "crc32c: rows of data may not overlap");
  at::Tensor out = at::empty({rows.size(0)}, data.options().dtype(at::kLong));
  kernels().crc32c(rows, out);
  return data.dim() == 1 ? out.reshape({}) : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsecomm, CPU, m) {
  m.impl("ef_topk_pack", &ef_topk_pack_cpu);
  m.impl("ef_threshold_pack", &ef_threshold_pack_cpu);
  m.impl("unpack_add", &unpack_add_cpu);
  m.impl("chunk_encode", &chunk_encode_cpu);
  m.impl("chunk_decode_add", &chunk_decode_add_cpu);
  m.impl("crc32c", &crc32c_cpu);
}

}  // namespace sparsecomm
