// ef_threshold_pack on CUDA: fused error feedback + selection by a given threshold +
// packing, in ONE pass over the bucket and with no host synchronisation (csrc/README.md).
//
// Selected: key(acc) >= key(float32(threshold)), at most capacity = indices_out.numel()
// of them, the lowest indices first. "Lowest indices first" needs, for every selected
// entry, the number of selected entries before it; a decoupled look-back over tiles of
// 4096 entries (radix_select.cuh) gives each tile that prefix in the same pass, so the
// kernel reads grad (+ residual) once and writes the residual once: the read-read-write
// floor. The payload comes out in ascending index order (like the reference).
//
// Launches (current stream; grids from n and the capacity only):
//   0. at::zeros(workspace): ceil(n / 4096) look-back words + 1 tile ticket (8 B each:
//      195 KiB at n = 1e8); the count: at::empty (0-d int64), written by the last tile
//      (at::zeros when n == 0).
//   1. threshold_pack_kernel: per tile: acc = EF(grad, residual); flags; look-back ->
//      slots; entries with slot < capacity are packed and their residual becomes
//      acc - T(wire), every other residual becomes acc (+0 for a non-finite acc, sent or
//      not: csrc/README.md); the last tile writes count = min(total, capacity).
//   2. pad_kernel: slots [count, capacity) get (index 0, value +0), as in the reference.
//
// Edge cases: n == 0 (no pass; count 0; all capacity slots padded); capacity == 0 (nothing
// sent, the pass still writes the residual; count 0); threshold 0 / -0 (key 0: every entry
// is selected, the first `capacity` are sent); threshold NaN/Inf (only NaN/Inf keys at or
// above it); more selected than the capacity (the later ones stay in the residual, exactly
// like unselected entries); a non-finite acc, sent or not (+0 in the residual, so nothing
// NaN stays behind); residual None (no residual reads or writes, add_residual must be
// False); index_offset (checked to fit int32).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>

#include "radix_select.cuh"

namespace sparsecomm_cuda {
namespace {

template <typename T, typename V>
__global__ void __launch_bounds__(kThreads) threshold_pack_kernel(
    const T* __restrict__ grad, T* __restrict__ residual, bool add_residual, float divisor_f, int64_t n,
    uint32_t bar, int32_t* __restrict__ indices_out, V* __restrict__ values_out, int64_t capacity,
    int64_t index_offset, uint64_t* status, uint32_t* tile_counter, int64_t* count_out) {
  __shared__ TileRankShared<1> sh;
  const uint32_t num_tiles = static_cast<uint32_t>((n + kTile - 1) / kTile);
  for (;;) {
    const uint32_t tile = next_tile(tile_counter, &sh);
    if (tile >= num_tiles) break;
    const int64_t base = static_cast<int64_t>(tile) * kTile + threadIdx.x;
    T g[kItems];
    T r[kItems];
    load_tile(grad, residual, add_residual, base, n, g, r);
    T acc[kItems];
    uint32_t mask[1] = {0u};
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + static_cast<int64_t>(j) * kThreads;
      if (i < n) {
        acc[j] = add_residual ? compensate(g[j], r[j], divisor_f) : compensate(g[j], divisor_f);
        if (magnitude_key(to_float(acc[j])) >= bar) mask[0] |= 1u << j;
      }
    }
    tile_rank<1>(mask, tile, status, &sh);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + static_cast<int64_t>(j) * kThreads;
      const bool selected = (mask[0] >> j) & 1u;
      const uint32_t ballot = __ballot_sync(kFullMask, selected);
      if (i < n) {
        T remainder = unsent_remainder(acc[j]);
        if (selected) {
          const int64_t slot = tile_slot(&sh, 0, j, ballot);
          if (slot < capacity) {
            const V wire = to_wire<T, V>(acc[j]);
            indices_out[slot] = static_cast<int32_t>(i + index_offset);
            values_out[slot] = wire;
            remainder = sent_remainder<T, V>(acc[j], wire);
          }
        }
        if (residual != nullptr) residual[i] = remainder;
      }
    }
    if (tile == num_tiles - 1 && threadIdx.x == 0) {
      const int64_t total = sh.inclusive[0];
      *count_out = total < capacity ? total : capacity;
    }
  }
}

// Slots [count, capacity) -> (index 0, value +0).
template <typename V>
__global__ void __launch_bounds__(kThreads) pad_kernel(int32_t* __restrict__ indices_out, V* __restrict__ values_out,
                                                       int64_t capacity, const int64_t* count) {
  const int64_t first = *count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = first + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < capacity; p += stride) {
    indices_out[p] = 0;
    values_out[p] = from_float<V>(0.0f);
  }
}

template <typename T, typename V>
void launch_ef_threshold_pack(const at::Tensor& grad, const at::Tensor* residual, float divisor_f,
                              bool add_residual, uint32_t bar, const at::Tensor& indices_out,
                              const at::Tensor& values_out, int64_t index_offset, const at::Tensor& count) {
  const int64_t n = grad.numel();
  const int64_t capacity = indices_out.numel();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  int32_t* indices_ptr = indices_out.mutable_data_ptr<int32_t>();
  V* values_ptr = values_out.mutable_data_ptr<V>();
  int64_t* count_ptr = count.mutable_data_ptr<int64_t>();
  if (n > 0) {
    const int64_t num_tiles = ceil_div(n, kTile);
    at::Tensor workspace = at::zeros({num_tiles + 1}, grad.options().dtype(at::kLong));
    auto* status = reinterpret_cast<uint64_t*>(workspace.mutable_data_ptr<int64_t>());
    auto* tile_counter = reinterpret_cast<uint32_t*>(status + num_tiles);
    T* residual_ptr = residual != nullptr ? residual->mutable_data_ptr<T>() : nullptr;
    threshold_pack_kernel<T, V><<<persistent_grid(num_tiles), kThreads, 0, stream>>>(
        grad.const_data_ptr<T>(), residual_ptr, add_residual, divisor_f, n, bar, indices_ptr, values_ptr, capacity,
        index_offset, status, tile_counter, count_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (capacity > 0) {
    pad_kernel<V><<<persistent_grid(ceil_div(capacity, kThreads)), kThreads, 0, stream>>>(indices_ptr, values_ptr,
                                                                                          capacity, count_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

at::Tensor ef_threshold_pack_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double divisor,
                                  bool add_residual, double threshold, const at::Tensor& indices_out,
                                  const at::Tensor& values_out, int64_t index_offset) {
  constexpr const char* op = "ef_threshold_pack";
  const at::Tensor* residual_ptr =
      check_pack_arguments(op, grad, residual, add_residual, divisor, index_offset, indices_out, values_out);
  const int64_t n = grad.numel();
  TORCH_CHECK(values_out.numel() >= indices_out.numel(), op, ": values_out holds ", values_out.numel(),
              " entries, indices_out ", indices_out.numel());

  const c10::cuda::CUDAGuard device_guard(grad.device());
  // key(float32(threshold)): the double rounds to float32 (nearest even) as torch.tensor does.
  const float threshold_f = static_cast<float>(threshold);
  uint32_t bar;
  std::memcpy(&bar, &threshold_f, sizeof(bar));
  bar = std::min(bar & 0x7FFFFFFFu, 0x7F800001u);  // one key for every NaN, as magnitude_key
  const float divisor_f = static_cast<float>(divisor);  // float(divisor), as the contract
  at::Tensor count = n > 0 ? at::empty({}, grad.options().dtype(at::kLong))
                           : at::zeros({}, grad.options().dtype(at::kLong));
  dispatch_float_dtype(grad.scalar_type(), op, "grad", [&](auto grad_tag) {
    using T = typename decltype(grad_tag)::type;
    dispatch_float_dtype(values_out.scalar_type(), op, "values_out", [&](auto value_tag) {
      using V = typename decltype(value_tag)::type;
      launch_ef_threshold_pack<T, V>(grad, residual_ptr, divisor_f, add_residual, bar, indices_out, values_out,
                                     index_offset, count);
    });
  });
  return count;
}

}  // namespace
}  // namespace sparsecomm_cuda

TORCH_LIBRARY_IMPL(sparsecomm, CUDA, m) {
  m.impl("ef_threshold_pack", &sparsecomm_cuda::ef_threshold_pack_cuda);
}
