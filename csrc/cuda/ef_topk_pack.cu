// ef_topk_pack on CUDA: fused error feedback + exact top-k + packing, with no host
// synchronisation (see csrc/README.md for the contract).
//
// Exact top-k with ties broken by the lowest index is the top-k of a *composite* key
//     c(i) = key(acc[i]) << 31 | (2^31 - 1 - i)          (62 bits, all distinct)
// (larger magnitude first; among equal magnitudes the lower index has the larger c). The
// selection is a radix select on c, most significant digit first, with the digits of the
// CPU kernels for the magnitude (12 + 12 + 7 bits) followed by the same 12 + 12 + 7 split
// of the inverted index:
//     level   0    1    2    3    4    5
//     shift   50   38   31   19   7    0      digit_l(c) = (c >> shift) & (2^bits - 1)
//     bits    12   12   7    12   12   7
// Every level keeps the invariant  above < need <= above + hist[b]  and stops as soon as
// the boundary bin is taken whole (need == hist[b]); then `cut` = the bin's lower edge and
// the selected set is exactly {c >= cut}. Level 5 bins hold one entry each, so the search
// always ends by level 5 (for random data it ends at level 2: the k-th key is unique).
//
// Launches (all on the current stream, grids computed from n on the host, nothing read
// back):
//   0. at::zeros(workspace)                                   (state, histograms, look-back)
//   1. pass1   over n:  acc = EF(grad, residual); residual = acc; level-0 histogram
//              (block-local shared histogram, then atomics into the global one). The last
//              block to finish finds the boundary bin b1 and `need`, and picks the mode.
//   2. pass2   over n (candidate mode only): reads acc (from residual, or recomputed from
//              grad), emits every entry with digit0 > b1 (or >= b1 when level 0 already
//              decided) into the payload and updates its residual; writes the indices of
//              the boundary-bin entries (the candidates) to a list. Slots come from a
//              decoupled look-back over tiles, so the payload and the candidate list are in
//              index order and the same on every run.
//   3. refine  x5 (levels 1..5; each returns at once when the cut is known): histogram of
//              the next digit over the candidates that still match the prefix; the last
//              block picks the next bin.
//   4. final   over the candidates: emits {c >= cut} after the entries of pass 2 (look-back
//              again) and updates their residuals; unselected non-finite candidates get +0.
// Modes, decided on the device by pass 1's last block:
//   * candidate mode (the usual one): boundary bin holds <= candidate_capacity entries;
//     refine/final touch only the candidates. Traffic for fp32 with a residual: pass 1 reads
//     grad + residual and writes residual, pass 2 reads residual: 4 x 4n bytes (the
//     read-read-write floor is 3 x 4n), plus O(candidates).
//   * full mode (degenerate data, e.g. most entries equal or zero, so the boundary bin holds
//     more than candidate_capacity entries): pass 2 does nothing, refine and final scan all
//     n entries (filtered by prefix). Slower (up to 6 more reads of n) but needs no
//     workspace proportional to n beyond the fixed candidate list.
//     Why pass 2 emits nothing in full mode: a refine level re-reads acc from the residual,
//     and an entry whose residual pass 2 had already replaced by acc - sent would be
//     misread; in full mode the residual keeps acc until the final pass.
//
// Workspace (caching allocator, with the input's device):
//   * zeroed int64 words: TopkState (256 B) + histograms (16640 x 4 B = 65 KiB) + two
//     look-back status arrays (ceil(n / 4096) x 8 B each: 195 KiB per array at n = 1e8);
//   * candidate list, not zeroed: min(n, max(2^20, n / 8)) int32 (50 MB at n = 1e8; 4 MB up
//     to n = 2^20).
//
// Edge cases (walked through):
//   * k == n: level 0's boundary bin is the lowest non-empty bin and need == hist[b1], so
//     pass 1 decides (cut = b1 << 50); pass 2 emits every entry; no candidates.
//   * k == 1: boundary bin = highest non-empty bin (NaN/Inf first), refinement until the
//     bin holds exactly the one entry; with ties the index levels pick the lowest index.
//   * n == 1: k == 1 == n, as above.
//   * all-equal input, k < n: one level-0 bin holds n entries; candidate mode if n fits the
//     candidate list (n <= 2^20 always does), else full mode; levels 1 and 2 keep the single
//     key bin, levels 3..5 (index) select the k lowest indices exactly.
//   * need == hist[b] at any level: done at that level, later levels return at once.
//   * NaN / Inf: keys above every finite key, so they are in the highest bins and selected
//     first; every NaN has one key (0x7F800001), so ties among NaNs go to the lowest indices.
//     A sent one leaves +0 in the residual (sent_remainder). An unsent one can only be in the
//     level-0 boundary bin (every non-finite key is in bin 4080, and pass 2 sends everything
//     above the boundary bin), i.e. in the final pass's domain, which writes +0 for it.
//   * residual None: add_residual must be False (checked); acc is recomputed from grad by
//     every pass (a pure function, so every pass sees the same acc), no residual writes.
//   * residual given, add_residual False: acc = EF(grad) only; the residual is overwritten.
//   * index_offset: written as int32(i + index_offset), checked on the host to fit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "radix_select.cuh"

namespace sparsecomm_cuda {
namespace {

constexpr int kLevels = 6;
constexpr int kLevelShift[kLevels] = {50, 38, 31, 19, 7, 0};
constexpr int kLevelBits[kLevels] = {12, 12, 7, 12, 12, 7};
constexpr int kHistogramWords = 4096 + 4096 + 128 + 4096 + 4096 + 128;  // 16640
constexpr uint32_t kModeCandidates = 0;
constexpr uint32_t kModeFull = 1;

struct TopkState {
  uint64_t prefix;  // composite bits decided so far (c >> shift of the last decided level)
  uint64_t cut;     // once done: selected  <=>  c >= cut
  uint32_t need;    // entries still to select among those matching `prefix`
  uint32_t done;
  uint32_t mode;        // kModeCandidates or kModeFull
  uint32_t bin0;        // level-0 boundary bin
  uint32_t sent;        // payload entries written by pass 2
  uint32_t candidates;  // candidates written by pass 2
  uint32_t tickets[kLevels];   // "last block" tickets of the histogram kernels
  uint32_t tile_counters[2];   // look-back tile tickets: pass 2, final pass
};
constexpr int64_t kStateBytes = 256;
static_assert(sizeof(TopkState) <= kStateBytes, "TopkState grew");

__device__ __forceinline__ uint64_t composite(uint32_t key, int64_t i) {
  return (static_cast<uint64_t>(key) << 31) | static_cast<uint64_t>(0x7FFFFFFFu - static_cast<uint32_t>(i));
}

// acc of entry i for passes after pass 1: the residual holds acc (written by pass 1 and not
// yet changed for this entry), or, without a residual, EF(grad) again.
template <typename T>
__device__ __forceinline__ T load_acc(const T* grad, const T* residual, float divisor_f, int64_t i) {
  return residual != nullptr ? residual[i] : compensate(grad[i], divisor_f);
}

// ---- pass 1: fused EF + level-0 histogram; the last block picks b1 --------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) topk_pass1_kernel(const T* __restrict__ grad, T* __restrict__ residual,
                                                              bool add_residual, float divisor_f, int64_t n,
                                                              uint32_t k, uint32_t candidate_capacity,
                                                              uint32_t* hist0, TopkState* state) {
  __shared__ uint32_t hist[4096];
  __shared__ FindBinShared find;
  __shared__ uint32_t last_flag;
  for (int b = threadIdx.x; b < 4096; b += kThreads) hist[b] = 0;
  __syncthreads();

  const int64_t num_tiles = (n + kTile - 1) / kTile;
  uint32_t run_bin = 0;  // consecutive equal bins of one thread are added at once
  uint32_t run = 0;      // (all-equal or mostly-zero data would serialise on one bank)
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t base = tile * kTile + threadIdx.x;
    T g[kItems];
    T r[kItems];
    load_tile(grad, residual, add_residual, base, n, g, r);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + static_cast<int64_t>(j) * kThreads;
      if (i < n) {
        const T acc = add_residual ? compensate(g[j], r[j], divisor_f) : compensate(g[j], divisor_f);
        if (residual != nullptr) residual[i] = acc;
        const uint32_t bin = magnitude_key(to_float(acc)) >> 19;
        if (run != 0 && bin == run_bin) {
          ++run;
        } else {
          if (run != 0) atomicAdd(&hist[run_bin], run);
          run_bin = bin;
          run = 1;
        }
      }
    }
  }
  if (run != 0) atomicAdd(&hist[run_bin], run);
  flush_histogram(hist, hist0, 4096);
  if (!last_block_done(&state->tickets[0], &last_flag)) return;

  const BinChoice choice = block_find_bin(hist0, 4096, k, &find);
  if (threadIdx.x == 0) {
    CUDA_KERNEL_ASSERT(choice.bin != UINT32_MAX && "ef_topk_pack: level-0 histogram holds fewer than k entries");
    const uint32_t need = k - choice.above;
    state->bin0 = choice.bin;
    state->prefix = choice.bin;
    state->need = need;
    if (need == choice.count) {  // the whole bin is taken: done
      state->done = 1;
      state->cut = static_cast<uint64_t>(choice.bin) << 50;  // kLevelShift[0]
      state->mode = kModeCandidates;  // pass 2 emits everything, no candidates
    } else {
      state->done = 0;
      state->mode = choice.count <= candidate_capacity ? kModeCandidates : kModeFull;
    }
  }
}

// ---- pass 2: emit the entries above the boundary bin, list the candidates --------------
template <typename T, typename V>
__global__ void __launch_bounds__(kThreads) topk_pass2_kernel(const T* __restrict__ grad, T* __restrict__ residual,
                                                              float divisor_f, int64_t n, uint32_t k,
                                                              int32_t* __restrict__ indices_out,
                                                              V* __restrict__ values_out, int64_t index_offset,
                                                              int32_t* __restrict__ candidates, TopkState* state,
                                                              uint64_t* status) {
  __shared__ TileRankShared<2> sh;
  if (state->mode != kModeCandidates) return;  // full mode: the final pass emits everything
  const uint32_t bin0 = state->bin0;
  const bool done = state->done != 0;
  const uint32_t num_tiles = static_cast<uint32_t>((n + kTile - 1) / kTile);
  for (;;) {
    const uint32_t tile = next_tile(&state->tile_counters[0], &sh);
    if (tile >= num_tiles) break;
    const int64_t base = static_cast<int64_t>(tile) * kTile + threadIdx.x;
    T acc[kItems];
    uint32_t mask[2] = {0u, 0u};  // [0]: sure (sent now), [1]: candidate
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + static_cast<int64_t>(j) * kThreads;
      if (i < n) acc[j] = load_acc(grad, residual, divisor_f, i);
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + static_cast<int64_t>(j) * kThreads;
      if (i < n) {
        const uint32_t digit = magnitude_key(to_float(acc[j])) >> 19;
        if (digit > bin0 || (done && digit == bin0)) {
          mask[0] |= 1u << j;
        } else if (!done && digit == bin0) {
          mask[1] |= 1u << j;
        }
      }
    }
    tile_rank<2>(mask, tile, status, &sh);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + static_cast<int64_t>(j) * kThreads;
      const bool sure = (mask[0] >> j) & 1u;
      const bool candidate = (mask[1] >> j) & 1u;
      const uint32_t sure_ballot = __ballot_sync(kFullMask, sure);
      const uint32_t candidate_ballot = __ballot_sync(kFullMask, candidate);
      if (sure) {
        const uint32_t slot = tile_slot(&sh, 0, j, sure_ballot);
        const V wire = to_wire<T, V>(acc[j]);
        indices_out[slot] = static_cast<int32_t>(i + index_offset);
        values_out[slot] = wire;
        if (residual != nullptr) residual[i] = sent_remainder<T, V>(acc[j], wire);
      }
      if (candidate) candidates[tile_slot(&sh, 1, j, candidate_ballot)] = static_cast<int32_t>(i);
    }
    if (tile == num_tiles - 1 && threadIdx.x == 0) {
      state->sent = sh.inclusive[0];
      state->candidates = sh.inclusive[1];
      CUDA_KERNEL_ASSERT((!done || sh.inclusive[0] == k) && "ef_topk_pack: pass 2 sent != k");
      CUDA_KERNEL_ASSERT(sh.inclusive[0] < k || done);
    }
  }
}

// ---- refine: one more digit of the composite key over the remaining candidates ---------
template <typename T>
__global__ void __launch_bounds__(kThreads) topk_refine_kernel(const T* __restrict__ grad,
                                                               const T* __restrict__ residual, float divisor_f,
                                                               int64_t n, const int32_t* __restrict__ candidates,
                                                               TopkState* state, uint32_t* level_hist, int level,
                                                               int shift, int bits) {
  __shared__ uint32_t hist[4096];
  __shared__ FindBinShared find;
  __shared__ uint32_t last_flag;
  // Read once: only this launch's last block writes the state, after every block is past here.
  if (state->done != 0) return;
  const bool candidate_mode = state->mode == kModeCandidates;
  const uint64_t prefix = state->prefix;
  const int bins = 1 << bits;
  const uint32_t digit_mask = static_cast<uint32_t>(bins - 1);
  const int prefix_shift = shift + bits;
  for (int b = threadIdx.x; b < bins; b += kThreads) hist[b] = 0;
  __syncthreads();

  const int64_t domain = candidate_mode ? static_cast<int64_t>(state->candidates) : n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < domain; p += stride) {
    const int64_t i = candidate_mode ? static_cast<int64_t>(candidates[p]) : p;
    const T acc = load_acc(grad, residual, divisor_f, i);
    const uint64_t c = composite(magnitude_key(to_float(acc)), i);
    if ((c >> prefix_shift) == prefix) atomicAdd(&hist[static_cast<uint32_t>(c >> shift) & digit_mask], 1u);
  }
  flush_histogram(hist, level_hist, bins);
  if (!last_block_done(&state->tickets[level], &last_flag)) return;

  const uint32_t need = state->need;
  const BinChoice choice = block_find_bin(level_hist, bins, need, &find);
  if (threadIdx.x == 0) {
    CUDA_KERNEL_ASSERT(choice.bin != UINT32_MAX && "ef_topk_pack: refinement histogram holds fewer than need entries");
    const uint32_t need_in_bin = need - choice.above;
    const uint64_t next_prefix = (prefix << bits) | choice.bin;
    if (need_in_bin == choice.count) {
      state->done = 1;
      state->cut = next_prefix << shift;
    } else {
      // Level 5 bins hold one entry each (composites are distinct): need_in_bin == 1 == count.
      CUDA_KERNEL_ASSERT(level < kLevels - 1 && "ef_topk_pack: selection not finished after the last level");
      state->prefix = next_prefix;
      state->need = need_in_bin;
    }
  }
}

// ---- final: emit {c >= cut} among the candidates (or among all entries in full mode) ---
template <typename T, typename V>
__global__ void __launch_bounds__(kThreads) topk_final_kernel(const T* __restrict__ grad, T* __restrict__ residual,
                                                              float divisor_f, int64_t n, uint32_t k,
                                                              int32_t* __restrict__ indices_out,
                                                              V* __restrict__ values_out, int64_t index_offset,
                                                              const int32_t* __restrict__ candidates,
                                                              TopkState* state, uint64_t* status) {
  __shared__ TileRankShared<1> sh;
  const bool candidate_mode = state->mode == kModeCandidates;
  const int64_t domain = candidate_mode ? static_cast<int64_t>(state->candidates) : n;
  const uint32_t sent = state->sent;  // 0 in full mode (pass 2 did nothing)
  const uint64_t cut = state->cut;
  const uint32_t num_tiles = static_cast<uint32_t>((domain + kTile - 1) / kTile);
  if (num_tiles == 0) return;  // level 0 decided: pass 2 sent all k
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    CUDA_KERNEL_ASSERT(state->done != 0 && "ef_topk_pack: no cut after the last level");
  }
  for (;;) {
    const uint32_t tile = next_tile(&state->tile_counters[1], &sh);
    if (tile >= num_tiles) break;
    const int64_t base = static_cast<int64_t>(tile) * kTile + threadIdx.x;
    T acc[kItems];
    int64_t index[kItems];
    uint32_t mask[1] = {0u};
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t p = base + static_cast<int64_t>(j) * kThreads;
      index[j] = 0;
      if (p < domain) {
        index[j] = candidate_mode ? static_cast<int64_t>(candidates[p]) : p;
        acc[j] = load_acc(grad, residual, divisor_f, index[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t p = base + static_cast<int64_t>(j) * kThreads;
      if (p < domain && composite(magnitude_key(to_float(acc[j])), index[j]) >= cut) mask[0] |= 1u << j;
    }
    tile_rank<1>(mask, tile, status, &sh);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t p = base + static_cast<int64_t>(j) * kThreads;
      const bool selected = (mask[0] >> j) & 1u;
      const uint32_t ballot = __ballot_sync(kFullMask, selected);
      if (selected) {
        const uint32_t slot = sent + tile_slot(&sh, 0, j, ballot);
        const V wire = to_wire<T, V>(acc[j]);
        indices_out[slot] = static_cast<int32_t>(index[j] + index_offset);
        values_out[slot] = wire;
        if (residual != nullptr) residual[index[j]] = sent_remainder<T, V>(acc[j], wire);
      } else if (residual != nullptr && p < domain && !is_finite_acc(acc[j])) {
        residual[index[j]] = unsent_remainder(acc[j]);  // +0: a non-finite acc is never kept
      }
    }
    if (tile == num_tiles - 1 && threadIdx.x == 0) {
      CUDA_KERNEL_ASSERT(sent + sh.inclusive[0] == k && "ef_topk_pack: payload does not hold exactly k entries");
    }
  }
}

template <typename T, typename V>
void launch_ef_topk_pack(const at::Tensor& grad, const at::Tensor* residual, float divisor_f, bool add_residual,
                         int64_t k, const at::Tensor& indices_out, const at::Tensor& values_out,
                         int64_t index_offset) {
  const int64_t n = grad.numel();
  const int64_t num_tiles = ceil_div(n, kTile);
  const int64_t candidate_capacity = std::min<int64_t>(n, std::max<int64_t>(int64_t{1} << 20, n / 8));

  // Workspace: one zeroed allocation (state | histograms | 2 look-back status arrays).
  const int64_t hist_offset = kStateBytes;
  const int64_t status2_offset = hist_offset + kHistogramWords * 4;
  const int64_t status_final_offset = status2_offset + num_tiles * 8;
  const int64_t workspace_bytes = status_final_offset + num_tiles * 8;
  at::Tensor workspace = at::zeros({ceil_div(workspace_bytes, 8)}, grad.options().dtype(at::kLong));
  at::Tensor candidate_list = at::empty({candidate_capacity}, grad.options().dtype(at::kInt));
  char* ws = static_cast<char*>(workspace.data_ptr());
  auto* state = reinterpret_cast<TopkState*>(ws);
  auto* hist = reinterpret_cast<uint32_t*>(ws + hist_offset);
  auto* status2 = reinterpret_cast<uint64_t*>(ws + status2_offset);
  auto* status_final = reinterpret_cast<uint64_t*>(ws + status_final_offset);
  uint32_t* level_hist[kLevels];
  for (int level = 0, offset = 0; level < kLevels; ++level) {
    level_hist[level] = hist + offset;
    offset += 1 << kLevelBits[level];
  }

  const T* grad_ptr = grad.const_data_ptr<T>();
  T* residual_ptr = residual != nullptr ? residual->mutable_data_ptr<T>() : nullptr;
  int32_t* indices_ptr = indices_out.mutable_data_ptr<int32_t>();
  V* values_ptr = values_out.mutable_data_ptr<V>();
  int32_t* candidates_ptr = candidate_list.mutable_data_ptr<int32_t>();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int grid = persistent_grid(num_tiles);

  topk_pass1_kernel<T><<<grid, kThreads, 0, stream>>>(grad_ptr, residual_ptr, add_residual, divisor_f, n,
                                                      static_cast<uint32_t>(k),
                                                      static_cast<uint32_t>(candidate_capacity), level_hist[0],
                                                      state);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  topk_pass2_kernel<T, V><<<grid, kThreads, 0, stream>>>(grad_ptr, residual_ptr, divisor_f, n,
                                                         static_cast<uint32_t>(k), indices_ptr, values_ptr,
                                                         index_offset, candidates_ptr, state, status2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (int level = 1; level < kLevels; ++level) {
    topk_refine_kernel<T><<<grid, kThreads, 0, stream>>>(grad_ptr, residual_ptr, divisor_f, n, candidates_ptr,
                                                         state, level_hist[level], level, kLevelShift[level],
                                                         kLevelBits[level]);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  topk_final_kernel<T, V><<<grid, kThreads, 0, stream>>>(grad_ptr, residual_ptr, divisor_f, n,
                                                         static_cast<uint32_t>(k), indices_ptr, values_ptr,
                                                         index_offset, candidates_ptr, state, status_final);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ef_topk_pack_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual, double divisor,
                       bool add_residual, int64_t k, const at::Tensor& indices_out, const at::Tensor& values_out,
                       int64_t index_offset) {
  constexpr const char* op = "ef_topk_pack";
  const at::Tensor* residual_ptr =
      check_pack_arguments(op, grad, residual, add_residual, divisor, index_offset, indices_out, values_out);
  const int64_t n = grad.numel();
  TORCH_CHECK(k >= 1 && k <= n, op, ": k must be in [1, ", n, "], got ", k);
  TORCH_CHECK(indices_out.numel() >= k && values_out.numel() >= k, op, ": indices_out and values_out must hold k=", k,
              " entries, got ", indices_out.numel(), " and ", values_out.numel());

  const c10::cuda::CUDAGuard device_guard(grad.device());
  const float divisor_f = static_cast<float>(divisor);  // float(divisor), as the contract
  dispatch_float_dtype(grad.scalar_type(), op, "grad", [&](auto grad_tag) {
    using T = typename decltype(grad_tag)::type;
    dispatch_float_dtype(values_out.scalar_type(), op, "values_out", [&](auto value_tag) {
      using V = typename decltype(value_tag)::type;
      launch_ef_topk_pack<T, V>(grad, residual_ptr, divisor_f, add_residual, k, indices_out, values_out,
                                index_offset);
    });
  });
}

}  // namespace
}  // namespace sparsecomm_cuda

TORCH_LIBRARY_IMPL(sparsecomm, CUDA, m) {
  m.impl("ef_topk_pack", &sparsecomm_cuda::ef_topk_pack_cuda);
}
