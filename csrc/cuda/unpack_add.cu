// unpack_add on CUDA: scatter-add world_size payload rows into the dense bucket, in rank
// order, bitwise as  out.index_add_(0, idx.long(), values.to(out.dtype))  per row on CUDA.
//
// One launch per row, in row order on the current stream: rows must be added in rank order
// (floating-point addition does not commute across the same index), and a stream orders
// launches without any host synchronisation. Inside a row, entries are added with the same
// atomics torch's index_add_ uses (gpuAtomicAddNoReturn): a payload holds each index at
// most once, except the (index 0, value +0) padding of threshold payloads, which may repeat
// and is harmless with atomics in any order (x + 0 is x, except that -0 becomes +0, and
// that commutes with the other additions).
//   out[idx] = T(float(out[idx]) + float(T(value)))
// fp16/bf16: native 16-bit atomics (sm_70+/sm_80+) round the exact sum once, which equals
// the formula since float's 24 bits make the float-then-16-bit double rounding innocuous.
// fp32: torch's atomicAdd (atom.global.add.f32) flushes subnormal inputs/results to zero
// (PTX ISA), exactly like index_add_ on CUDA; the same instruction is used here.
//
// No workspace. Out-of-range indices: device assert (as index_add_), and skipped.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/Atomic.cuh>
#include <torch/library.h>

#include "radix_select.cuh"

namespace sparsecomm_cuda {
namespace {

template <typename T, typename V>
__global__ void __launch_bounds__(kThreads) unpack_row_kernel(const int32_t* __restrict__ indices,
                                                              int64_t index_stride, const V* __restrict__ values,
                                                              int64_t value_stride, int64_t k, T* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < k; p += stride) {
    const int64_t index = indices[p * index_stride];
    CUDA_KERNEL_ASSERT(index >= 0 && index < n && "unpack_add: index out of range");
    if (index < 0 || index >= n) continue;
    const V value = values[p * value_stride];
    T addend;
    if constexpr (std::is_same_v<T, V>) {
      addend = value;
    } else {
      addend = from_float<T>(to_float(value));  // values.to(T): through float, nearest even
    }
    gpuAtomicAddNoReturn(out + index, addend);
  }
}

void unpack_add_cuda(const at::Tensor& indices, const at::Tensor& values, const at::Tensor& out, bool zero_out) {
  constexpr const char* op = "unpack_add";
  TORCH_CHECK(indices.dim() == 2 && values.dim() == 2 && indices.sizes() == values.sizes(), op,
              ": indices and values must be [world_size, k], got ", indices.sizes(), " and ", values.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kInt, op, ": indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK(is_supported_float(values.scalar_type()), op, ": values must be float32, bfloat16 or float16, got ",
              values.scalar_type());
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), op, ": out must be a contiguous 1-D tensor");
  TORCH_CHECK(out.is_cuda(), op, ": out must be a CUDA tensor");
  TORCH_CHECK(is_supported_float(out.scalar_type()), op, ": out must be float32, bfloat16 or float16, got ",
              out.scalar_type());
  TORCH_CHECK(indices.device() == out.device() && values.device() == out.device(), op,
              ": indices, values and out must be on one device");
  TORCH_CHECK(out.numel() <= std::numeric_limits<int32_t>::max(), op, ": out has ", out.numel(),
              " elements; int32 indices address at most 2^31 - 1");
  for (int64_t d = 0; d < 2; ++d) {
    TORCH_CHECK(indices.stride(d) >= 0 && values.stride(d) >= 0, op, ": negative strides are not supported");
  }
  check_no_overlap(op, "out", out, "indices", indices);
  check_no_overlap(op, "out", out, "values", values);

  const c10::cuda::CUDAGuard device_guard(out.device());
  if (zero_out) out.zero_();
  const int64_t world_size = indices.size(0);
  const int64_t k = indices.size(1);
  const int64_t n = out.numel();
  if (world_size == 0 || k == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int grid = persistent_grid(ceil_div(k, kThreads));
  const int32_t* index_base = indices.const_data_ptr<int32_t>();
  dispatch_float_dtype(out.scalar_type(), op, "out", [&](auto out_tag) {
    using T = typename decltype(out_tag)::type;
    dispatch_float_dtype(values.scalar_type(), op, "values", [&](auto value_tag) {
      using V = typename decltype(value_tag)::type;
      const V* value_base = values.const_data_ptr<V>();
      T* out_ptr = out.mutable_data_ptr<T>();
      for (int64_t row = 0; row < world_size; ++row) {
        unpack_row_kernel<T, V><<<grid, kThreads, 0, stream>>>(index_base + row * indices.stride(0),
                                                               indices.stride(1),
                                                               value_base + row * values.stride(0),
                                                               values.stride(1), k, out_ptr, n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
}

}  // namespace
}  // namespace sparsecomm_cuda

TORCH_LIBRARY_IMPL(sparsecomm, CUDA, m) {
  m.impl("unpack_add", &sparsecomm_cuda::unpack_add_cuda);
}
