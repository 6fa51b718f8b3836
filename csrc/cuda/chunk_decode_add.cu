// chunk_decode_add on CUDA: decode world_size chunked payloads and add them, in rank order,
// into the dense bucket: bitwise what ChunkLayout.views + one index_add_ per row give on CPU
// (and what csrc/cpu/chunk_decode_add.cpp computes), NaN at the same places.
//
// Chunks decode independently (every chunk's scale, index field or Rice bits and value
// fields start at a position known from the geometry), so one warp owns one chunk (a grid-
// stride loop over chunks, 8 warps a block) and adds every row's entries of it, row after
// row, with __syncwarp between rows: every element receives its adds in row order, each
//   out[i] = T(float(out[i]) + float(T(decoded)))
// with plain loads and stores (__fadd_rn: no flush to zero, unlike the f32 atomics torch's
// CUDA index_add_ uses, which would lose subnormal sums), since no other warp writes the
// chunk and inside a row a payload holds each position once. zero_out zeroes the chunk in the
// same warp first.
//   * int32 / chunk indices: the lanes take the row's entries of the chunk 32 at a time.
//   * rice: lane 0 walks the chunk's bits (as the CPU kernel: 57-bit windows) and decodes up
//     to 32 positions into shared memory, then the 32 lanes add those entries; repeat.
// A payload comes from another rank: an entry that decodes to a position outside its chunk
// (or a Rice code running past its chunk's bits) is skipped (never written outside the
// bucket) and trips a device assert (as unpack_add and index_add_ on CUDA do; raising a
// catchable error, as the CPU operator does, would need a host synchronisation).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../cpu/dispatch/chunk_checks.h"
#include "chunk_codecs.cuh"

namespace sparsecomm_cuda {
namespace {

using namespace sparsecomm;  // ChunkFormat, codec ids, chunk_format()

constexpr int kBatch = 32;  // Rice positions lane 0 decodes before the warp adds them

template <typename T>
__device__ __forceinline__ void add_to(T* dst, float value) {
  *dst = from_float<T>(__fadd_rn(to_float(*dst), to_float(from_float<T>(value))));
}

// The decoded value of payload entry e of one row (value_codecs.decode).
__device__ __forceinline__ float value_at(const ChunkFormat& f, const uint8_t* value_region, int64_t value_bytes,
                                          int64_t e, float scale) {
  uint32_t code;
  const int32_t vb = f.value_bits;
  if (vb == 32 || vb == 16 || vb == 8) {
    code = load_le(value_region + e * (vb / 8), vb / 8);
  } else {  // 1, 2 or 4 bits: inside one byte (fields start at multiples of their width)
    const int64_t bit = e * vb;
    code = (region_byte(value_region, value_bytes, bit >> 3) >> (bit & 7)) & ((1u << vb) - 1u);
  }
  return f.scaled ? decode_code(f.value_codec, code, scale) : float_wire_value(f.value_codec, code);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) chunk_decode_add_kernel(const uint8_t* __restrict__ gathered,
                                                                    int64_t rows, int64_t row_stride,
                                                                    const ChunkFormat f, T* out,
                                                                    bool zero_out) {
  __shared__ int32_t batch[kWarps][kBatch];
  const uint32_t lane = lane_id(), warp = warp_id();
  const int64_t index_bytes = f.value_start - f.index_start, value_bytes = f.value_end - f.value_start;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + warp; c < f.chunks; c += stride) {  // uniform in a warp
    const bool last = c == f.chunks - 1;
    const int64_t length = last ? f.last_length : f.chunk_size, k = last ? f.k_last : f.k_full;
    const int64_t begin = c * f.chunk_size, first = c * f.k_full;
    T* dst = out + begin;
    if (zero_out) {
      for (int64_t j = lane; j < length; j += 32) dst[j] = from_float<T>(0.0f);  // +0.0
    }
    __syncwarp();
    for (int64_t row = 0; row < rows; ++row) {
      const uint8_t* payload = gathered + row * row_stride;
      const uint8_t* index_region = payload + f.index_start;
      const uint8_t* value_region = payload + f.value_start;
      float scale = 0.0f;
      if (f.scaled) scale = __uint_as_float(load_le(payload + 2 * c, 2) << 16);
      if (f.index_codec == kIndexInt32) {
        for (int64_t j = lane; j < k; j += 32) {
          const int32_t index = static_cast<int32_t>(load_le(index_region + 4 * (first + j), 4));
          const int64_t local = static_cast<int64_t>(index) - begin;
          const bool inside = local >= 0 && local < length;
          CUDA_KERNEL_ASSERT(inside && "chunk_decode_add: an index outside its chunk: corrupt payload");
          if (inside) add_to(dst + local, value_at(f, value_region, value_bytes, first + j, scale));
        }
      } else if (f.index_codec == kIndexChunk) {
        const int bits = f.index_bits;
        for (int64_t j = lane; j < k; j += 32) {
          const int64_t local = read_field(index_region, index_bytes, (first + j) * bits, bits);
          const bool inside = local < length;
          CUDA_KERNEL_ASSERT(inside && "chunk_decode_add: an index outside its chunk: corrupt payload");
          if (inside) add_to(dst + local, value_at(f, value_region, value_bytes, first + j, scale));
        }
      } else {
        // Lane 0's walk (chunk_decode_add.cpp add_chunk, Rice branch); the state lives in lane 0.
        const int r = last ? f.rice_r_last : f.rice_r_full;
        const uint64_t low_mask = (uint64_t{1} << r) - 1;
        int64_t cursor = c * f.rice_bits_full;
        const int64_t end = cursor + (last ? f.rice_bits_last : f.rice_bits_full);
        int64_t local = -1;
        for (int64_t done = 0; done < k;) {  // done, n and stop are the same in every lane
          int n = 0;
          int stop = 0;
          if (lane == 0) {
            const int64_t want = k - done < kBatch ? k - done : kBatch;
            for (; n < want; ++n) {
              uint64_t window = peek_bits(index_region, index_bytes, cursor);
              int64_t quotient = 0;
              int ones = __ffsll(static_cast<long long>(~window | (uint64_t{1} << 57))) - 1;
              while (ones == 57 && cursor + 57 < end) {
                quotient += 57;
                cursor += 57;
                window = peek_bits(index_region, index_bytes, cursor);
                ones = __ffsll(static_cast<long long>(~window | (uint64_t{1} << 57))) - 1;
              }
              quotient += ones;
              cursor += ones + 1;  // the ones and the zero
              const int64_t low = ones + 1 + r <= 57
                                      ? static_cast<int64_t>((window >> (ones + 1)) & low_mask)
                                      : static_cast<int64_t>(read_field(index_region, index_bytes, cursor, r));
              cursor += r;
              local += ((quotient << r) | low) + 1;
              if (cursor > end || local >= length) {
                stop = 1;  // this entry and the rest of the chunk are skipped
                break;
              }
              batch[warp][n] = static_cast<int32_t>(local);
            }
            CUDA_KERNEL_ASSERT(!stop && "chunk_decode_add: a Rice code runs past its chunk: corrupt payload");
          }
          n = __shfl_sync(kFullMask, n, 0);
          stop = __shfl_sync(kFullMask, stop, 0);
          __syncwarp();  // batch[] written by lane 0 is visible to the warp
          if (static_cast<int>(lane) < n) {
            add_to(dst + batch[warp][lane], value_at(f, value_region, value_bytes, first + done + lane, scale));
          }
          __syncwarp();  // the adds are done before lane 0 rewrites batch[]
          done += n;
          if (stop) break;
        }
      }
      __syncwarp();  // this row's adds are visible before the next row's
    }
  }
}

void chunk_decode_add_cuda(const at::Tensor& gathered, int64_t chunk_size, int64_t k_full, int64_t k_last,
                           int64_t index_codec, int64_t value_codec, int64_t scale_group, const at::Tensor& out,
                           bool zero_out) {
  // The CPU operator's checks (csrc/cpu/dispatch/chunk_checks.h), and that out is a CUDA tensor.
  TORCH_CHECK(out.is_cuda(), "chunk_decode_add: out must be a CUDA tensor");
  const ChunkFormat f = check_chunk_decode_add(gathered, chunk_size, k_full, k_last, index_codec, value_codec,
                                               scale_group, out);
  // sparsecomm/ops/dispatch.py sends such layouts elsewhere (csrc/README.md).
  TORCH_CHECK(f.scale_group == 0, "chunk_decode_add: the CUDA kernel takes no scale_group (got ", f.scale_group, ")");
  TORCH_CHECK(is_supported_float(out.scalar_type()),
              "chunk_decode_add: dtype must be float32, bfloat16 or float16, got ", out.scalar_type());

  const c10::cuda::CUDAGuard device_guard(out.device());
  const PayloadRows payloads = payload_rows(gathered, f);  // no structured binding: the lambda below uses them
  const int64_t rows = payloads.rows, row_stride = payloads.stride;
  if (rows == 0 && !zero_out) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = ceil_div(f.chunks, kWarps);
  const int grid = static_cast<int>(std::min<int64_t>(blocks, static_cast<int64_t>(multiprocessor_count()) * 16));
  const uint8_t* base = rows > 0 ? gathered.const_data_ptr<uint8_t>() : nullptr;
  dispatch_float_dtype(out.scalar_type(), "chunk_decode_add", "out", [&](auto tag) {
    using T = typename decltype(tag)::type;
    chunk_decode_add_kernel<T><<<grid, kThreads, 0, stream>>>(base, rows, row_stride, f, out.mutable_data_ptr<T>(),
                                                                zero_out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace sparsecomm_cuda

TORCH_LIBRARY_IMPL(sparsecomm, CUDA, m) {
  m.impl("chunk_decode_add", &sparsecomm_cuda::chunk_decode_add_cuda);
}
