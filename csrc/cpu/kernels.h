// The CPU kernels of one level: what csrc/cpu/<op>.cpp defines in sparsecomm::cpu_<level>,
// and what dispatch/cpu_ops.cpp calls once it has checked the arguments (csrc/README.md,
// "Errors") and chosen the level. Each kernel dispatches on the dtypes itself.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

#include "chunk_format.h"
#include "cpu_levels.h"

namespace sparsecomm {

using EfTopkPackKernel = void(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, float divisor,
                              bool add_residual, int64_t k, const at::Tensor& indices_out,
                              const at::Tensor& values_out, int64_t index_offset);
// Returns how many entries were sent.
using EfThresholdPackKernel = int64_t(const at::Tensor& grad, const c10::optional<at::Tensor>& residual,
                                      float divisor, bool add_residual, float threshold,
                                      const at::Tensor& indices_out, const at::Tensor& values_out,
                                      int64_t index_offset);
// Returns how many indices lay outside the bucket (skipped: the caller raises).
using UnpackAddKernel = int64_t(const at::Tensor& indices, const at::Tensor& values, const at::Tensor& out,
                                bool zero_out);

// Writes payload (f.nbytes), indices (int64) and decoded (f.selected each); updates residual.
// chunk_encode takes layouts with f.scale_group == 0, compact_encode those with one.
using ChunkEncodeKernel = void(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, float divisor,
                               bool add_residual, const ChunkFormat& f, const at::Tensor& payload,
                               const at::Tensor& indices, const at::Tensor& decoded);
// Decodes `rows` payloads, `row_stride` bytes apart from the start of gathered. Returns how
// many entries were corrupt (skipped: the caller raises). chunk_decode_add takes layouts with
// f.scale_group == 0, compact_decode_add those with one.
using ChunkDecodeAddKernel = int64_t(const at::Tensor& gathered, const ChunkFormat& f, int64_t rows,
                                     int64_t row_stride, const at::Tensor& out, bool zero_out);
// CRC-32C of every row of data (uint8 [rows, n], contiguous rows) into out (int64 [rows]).
using Crc32cKernel = void(const at::Tensor& data, const at::Tensor& out);

struct CpuKernels {
  EfTopkPackKernel* ef_topk_pack;
  EfThresholdPackKernel* ef_threshold_pack;
  UnpackAddKernel* unpack_add;
  ChunkEncodeKernel* chunk_encode;
  ChunkDecodeAddKernel* chunk_decode_add;
  ChunkEncodeKernel* compact_encode;
  ChunkDecodeAddKernel* compact_decode_add;
  Crc32cKernel* crc32c;
};

#define SPARSECOMM_DECLARE_CPU_KERNELS(LEVEL_NAMESPACE) \
  namespace LEVEL_NAMESPACE {                           \
  EfTopkPackKernel ef_topk_pack;                        \
  EfThresholdPackKernel ef_threshold_pack;              \
  UnpackAddKernel unpack_add;                           \
  ChunkEncodeKernel chunk_encode;                       \
  ChunkDecodeAddKernel chunk_decode_add;                \
  ChunkEncodeKernel compact_encode;                     \
  ChunkDecodeAddKernel compact_decode_add;              \
  Crc32cKernel crc32c;                                  \
  inline CpuKernels kernels() {                         \
    return {&ef_topk_pack, &ef_threshold_pack, &unpack_add, &chunk_encode, &chunk_decode_add, &compact_encode, \
            &compact_decode_add, &crc32c};                                                                     \
  }                                                     \
  }

SPARSECOMM_DECLARE_CPU_KERNELS(cpu_default)
#if SPARSECOMM_CPU_X86_LEVELS
SPARSECOMM_DECLARE_CPU_KERNELS(cpu_avx2)
SPARSECOMM_DECLARE_CPU_KERNELS(cpu_avx512)
#endif

#undef SPARSECOMM_DECLARE_CPU_KERNELS

}  // namespace sparsecomm
