// Shared pieces of the CUDA kernels (csrc/cuda/*.cu): the error-feedback arithmetic and
// magnitude keys of csrc/README.md, dtype dispatch, argument checks, and the block-level
// building blocks of the radix selection: histogram "last block" selection, a tile ranker
// that gives every selected entry its payload slot in index order, and a decoupled
// look-back (single-pass prefix over tiles) so that no op ever synchronises with the host.
//
// Conventions shared by all kernels
// * kThreads = 256 threads per block; a *tile* is kItems = 16 entries per thread in a
//   striped layout: entry j of thread t of tile `tile` is  tile * kTile + j * kThreads + t,
//   so every load instruction of a warp reads consecutive addresses (coalesced) and the
//   index order inside a tile is (j, warp, lane).
// * Counts are uint32: every op checks n <= 2^31 - 1 on the host.
// * Only relaxed atomics cross blocks; kernels communicate through global memory between
//   launches on the same stream (kernel boundaries order everything else).
//
// Headers: only c10/cuda and ATen core headers are included on purpose. ATen/cuda/CUDAContext.h
// pulls in cuBLAS/cuSPARSE headers, which a bare nvcc toolkit (or a CPU torch + nvcc, as in
// tests/test_cuda_sources_compile.py) does not have; nothing here needs them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

// __nanosleep, ld/st.relaxed.gpu and the 16-bit atomics of unpack_add need Volta or newer
// (TORCH_CUDA_ARCH_LIST entries >= 7.0; H100/H200 are 9.0).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "sparsecomm CUDA kernels need compute capability 7.0 or newer (set TORCH_CUDA_ARCH_LIST accordingly)"
#endif

namespace sparsecomm_cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 16;
constexpr int kTile = kThreads * kItems;  // 4096 entries

// Coalesced loads of one tile of grad (and the residual, when it is added): thread t reads
// entries base + j * kThreads, j < kItems; entries at or past n are left unset.
template <typename T>
__device__ __forceinline__ void load_tile(const T* __restrict__ grad, const T* __restrict__ residual,
                                          bool add_residual, int64_t base, int64_t n, T (&g)[kItems],
                                          T (&r)[kItems]) {
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = base + static_cast<int64_t>(j) * kThreads;
    if (i < n) {
      g[j] = grad[i];
      if (add_residual) r[j] = residual[i];
    }
  }
}
constexpr uint32_t kFullMask = 0xFFFFFFFFu;

// ---------------------------------------------------------------------------------------
// Host: dtype dispatch, argument checks, launch geometry
// ---------------------------------------------------------------------------------------

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) for T = float, c10::BFloat16 or c10::Half (the dtypes of the
// contract); any other dtype is a caller error.
template <typename F>
inline void dispatch_float_dtype(at::ScalarType dtype, const char* op, const char* arg, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(TypeTag<float>{});
      break;
    case at::kBFloat16:
      f(TypeTag<c10::BFloat16>{});
      break;
    case at::kHalf:
      f(TypeTag<c10::Half>{});
      break;
    default:
      TORCH_CHECK(false, op, ": ", arg, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

inline void check_vector(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), op, ": ", arg, " must be a contiguous 1-D tensor, got shape ",
              t.sizes());
  TORCH_CHECK(t.device() == like.device(), op, ": ", arg, " is on ", t.device(), ", expected ", like.device());
}

// [first byte, last byte + 1) of the elements a tensor can address (non-negative strides).
inline std::pair<uintptr_t, uintptr_t> byte_extent(const at::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (t.numel() == 0) return {begin, begin};
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

inline void check_no_overlap(const char* op, const char* a_name, const at::Tensor& a, const char* b_name,
                             const at::Tensor& b) {
  const auto ea = byte_extent(a);
  const auto eb = byte_extent(b);
  const bool overlap = ea.first < ea.second && eb.first < eb.second && ea.first < eb.second && eb.first < ea.second;
  TORCH_CHECK(!overlap, op, ": ", a_name, " and ", b_name, " overlap in memory (aliasing is not allowed)");
}

// Argument checks of ef_topk_pack (raised before any launch); the op adds its own k check.
// Returns the residual or nullptr.
inline const at::Tensor* check_pack_arguments(const char* op, const at::Tensor& grad,
                                              const c10::optional<at::Tensor>& residual, bool add_residual,
                                              double divisor, int64_t index_offset, const at::Tensor& indices_out,
                                              const at::Tensor& values_out) {
  check_vector(op, "grad", grad, grad);
  TORCH_CHECK(grad.is_cuda(), op, ": grad must be a CUDA tensor");
  TORCH_CHECK(is_supported_float(grad.scalar_type()), op, ": grad must be float32, bfloat16 or float16, got ",
              grad.scalar_type());
  const int64_t n = grad.numel();
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": grad has ", n,
              " elements; int32 indices allow at most 2^31 - 1");
  TORCH_CHECK(divisor > 0, op, ": divisor must be > 0, got ", divisor);
  TORCH_CHECK(index_offset >= 0 && index_offset + n <= std::numeric_limits<int32_t>::max(), op,
              ": index_offset + n must fit in int32, got index_offset=", index_offset, " n=", n);
  check_vector(op, "indices_out", indices_out, grad);
  check_vector(op, "values_out", values_out, grad);
  TORCH_CHECK(indices_out.scalar_type() == at::kInt, op, ": indices_out must be int32, got ",
              indices_out.scalar_type());
  TORCH_CHECK(is_supported_float(values_out.scalar_type()), op,
              ": values_out must be float32, bfloat16 or float16, got ", values_out.scalar_type());
  TORCH_CHECK(!add_residual || residual.has_value(), op, ": add_residual=True needs a residual");
  if (residual.has_value()) {
    check_vector(op, "residual", *residual, grad);
    TORCH_CHECK(residual->numel() == n && residual->scalar_type() == grad.scalar_type(), op,
                ": residual must match grad (", n, " x ", grad.scalar_type(), "), got ", residual->numel(), " x ",
                residual->scalar_type());
    check_no_overlap(op, "residual", *residual, "grad", grad);
    check_no_overlap(op, "residual", *residual, "indices_out", indices_out);
    check_no_overlap(op, "residual", *residual, "values_out", values_out);
  }
  check_no_overlap(op, "indices_out", indices_out, "grad", grad);
  check_no_overlap(op, "values_out", values_out, "grad", grad);
  check_no_overlap(op, "indices_out", indices_out, "values_out", values_out);
  return residual.has_value() ? &*residual : nullptr;
}

// Multiprocessor count of the current device, cached (cudaDeviceGetAttribute does not
// synchronise, the cache just avoids the driver call on every op).
inline int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  const int device = c10::cuda::current_device();
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (count <= 0) count = 1;
  if (device >= 0 && device < kMaxDevices) cache[device].store(count, std::memory_order_relaxed);
  return count;
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Grid of a persistent kernel over `work_tiles` tiles: at most 8 resident blocks of 256
// threads per SM (2048 threads). Always >= 1 block. Any grid size is *correct* (the
// look-back hands tiles out by ticket, the histograms stride), this one is just enough to
// fill the GPU.
inline int persistent_grid(int64_t work_tiles) {
  const int64_t cap = static_cast<int64_t>(multiprocessor_count()) * 8;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(work_tiles, cap)));
}

// ---------------------------------------------------------------------------------------
// Device: the arithmetic of the contract (csrc/README.md)
// ---------------------------------------------------------------------------------------

// Conversions go through the c10 types, i.e. exactly the code torch's own CUDA casts run
// (__float2half / __float2bfloat16: round to nearest even).
template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}
template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

// Magnitude key: bits(float32(|x|)). Monotone for finite values, +-Inf above every finite
// value, NaN above Inf.
// Every NaN gets one key (0x7F800001, just above Inf): NaN payload bits differ between
// conversion paths, and one key makes the lower index win among NaNs on every backend.
__device__ __forceinline__ uint32_t magnitude_key(float x) {
  return min(__float_as_uint(x) & 0x7FFFFFFFu, 0x7F800001u);
}

// acc is finite: its key is below Inf's (0x7F800000).
template <typename T>
__device__ __forceinline__ bool is_finite_acc(T acc) {
  return magnitude_key(to_float(acc)) < 0x7F800000u;
}

// acc = T(float(grad) / float(divisor)), then T(float(acc) + float(residual)): the contract's
// two roundings (csrc/README.md), as torch on CPU computes grad.div_(divisor).add_(residual).
//
// Note: torch's *CUDA* div_ by a Python scalar computes a * (1 / b) instead (ATen/native/cuda/
// BinaryDivTrueKernel.cu), which differs in the last bit for some values (divisor 3: about a
// third of them). These kernels follow the contract, like the CPU and Triton kernels and the
// reference (error_feedback.divide_ divides by a device tensor to get a true division).
// __fdiv_rn / __fadd_rn: IEEE round-to-nearest whatever the -prec-div/-fmad flags, never
// contracted into an FMA. Do not build with --use_fast_math / -ftz=true: flushing subnormal
// results to zero would break bitwise agreement with the contract (and with the CPU kernels).
template <typename T>
__device__ __forceinline__ T compensate(T grad, float divisor) {
  return from_float<T>(__fdiv_rn(to_float(grad), divisor));
}
template <typename T>
__device__ __forceinline__ T compensate(T grad, T residual, float divisor) {
  const T acc = compensate(grad, divisor);
  return from_float<T>(__fadd_rn(to_float(acc), to_float(residual)));
}

template <typename V>
struct WireLimit;
template <>
struct WireLimit<float> {
  static constexpr float value = 3.40282346638528859812e+38f;
};
template <>
struct WireLimit<c10::BFloat16> {
  static constexpr float value = 3.38953138925153547590e+38f;  // 0x7F7F0000
};
template <>
struct WireLimit<c10::Half> {
  static constexpr float value = 65504.0f;
};

// A finite float a (acc, of dtype T) beyond V's largest value L, saturated: +-s, L rounded
// down to a multiple of a's ulp in T, so that s and a - s are multiples of that ulp below
// |a|, both exact in T (sent + residual == acc). L itself would not do: fp16's 65504 is
// 2047 x 32, and float32 from 2^29 on has an ulp of 64 or more; s is 0 once the ulp exceeds
// L (fp16: float32 from 2^39, bf16 from 2^23 on). Anything else passes unchanged. In float,
// where L and s are exact (clamping in bf16 would round 65504 up to 65536 -> fp16 Inf).
template <typename T, typename V>
__device__ __forceinline__ float saturate(float a) {
  if constexpr (WireLimit<V>::value < WireLimit<T>::value) {
    constexpr float limit = WireLimit<V>::value;
    const uint32_t magnitude = __float_as_uint(a) & 0x7FFFFFFFu;
    // finite (below the Inf pattern) and beyond V's range; NaN and +-Inf pass unchanged
    if (magnitude < 0x7F800000u && fabsf(a) > limit) {
      // a's exponent bits less T's mantissa width: its ulp
      const float ulp = __uint_as_float((magnitude & 0x7F800000u) - ((std::numeric_limits<T>::digits - 1u) << 23));
      a = copysignf(__fmul_rn(floorf(__fdiv_rn(limit, ulp)), ulp), a);
    }
  }
  return a;
}

// wire(a) = V(saturate(a)): only V narrower than T saturates (fp32 -> fp16/bf16, bf16 -> fp16).
// V == T returns acc itself, bit for bit (NaN payload included), like torch's no-op .to().
template <typename T, typename V>
__device__ __forceinline__ V to_wire(T acc) {
  if constexpr (std::is_same_v<T, V>) {
    return acc;
  } else {
    return from_float<V>(saturate<T, V>(to_float(acc)));
  }
}

// Residual of a sent entry: T(float(acc) - float(T(wire))), so that sent + residual == acc;
// +0 when acc is +-Inf or NaN (Inf - Inf = NaN kept there would rank first and be sent again
// on every later step).
template <typename T, typename V>
__device__ __forceinline__ T sent_remainder(T acc, V wire) {
  if (!is_finite_acc(acc)) return from_float<T>(0.0f);
  T back;
  if constexpr (std::is_same_v<T, V>) {
    back = wire;
  } else {
    back = from_float<T>(to_float(wire));
  }
  return from_float<T>(__fsub_rn(to_float(acc), to_float(back)));
}

// Residual of an entry that is not sent: acc, or +0 when acc is +-Inf or NaN (csrc/README.md:
// a non-finite acc is never kept in the residual, sent or not).
template <typename T>
__device__ __forceinline__ T unsent_remainder(T acc) {
  return is_finite_acc(acc) ? acc : from_float<T>(0.0f);
}

// ---------------------------------------------------------------------------------------
// Device: block-level building blocks (all assume blockDim.x == kThreads)
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t lane_id() {
  return threadIdx.x & 31u;
}
__device__ __forceinline__ uint32_t warp_id() {
  return threadIdx.x >> 5;
}
__device__ __forceinline__ uint32_t lanemask_lt() {
  return (1u << lane_id()) - 1u;
}

__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t y = __shfl_up_sync(kFullMask, v, d);
    if (lane_id() >= static_cast<uint32_t>(d)) v += y;
  }
  return v;
}

// Inclusive scan over the block (thread order). All threads must call it.
// `warp_sums`: shared, kWarps entries.
__device__ __forceinline__ uint32_t block_inclusive_scan(uint32_t v, uint32_t* warp_sums) {
  const uint32_t inclusive = warp_inclusive_scan(v);
  if (lane_id() == 31) warp_sums[warp_id()] = inclusive;
  __syncthreads();
  uint32_t offset = 0;
  for (uint32_t w = 0; w < warp_id(); ++w) offset += warp_sums[w];
  __syncthreads();  // warp_sums may be reused right after
  return inclusive + offset;
}

// Adds a block's shared histogram into the global one (only non-empty bins).
__device__ __forceinline__ void flush_histogram(const uint32_t* shared_hist, uint32_t* global_hist, int bins) {
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += kThreads) {
    const uint32_t c = shared_hist[b];
    if (c != 0) atomicAdd(global_hist + b, c);
  }
}

// "Last block done" (the CUDA threadFenceReduction pattern): returns true, in every thread
// of exactly one block, once all gridDim.x blocks have called it; that block then sees all
// other blocks' global atomics/stores. Every block of the grid must call it exactly once.
__device__ __forceinline__ bool last_block_done(uint32_t* ticket, uint32_t* shared_flag) {
  __threadfence();  // this thread's global writes/atomics are visible before the ticket
  __syncthreads();
  if (threadIdx.x == 0) *shared_flag = (atomicAdd(ticket, 1u) == gridDim.x - 1) ? 1u : 0u;
  __syncthreads();
  const bool last = *shared_flag != 0;
  if (last) __threadfence();
  return last;
}

struct BinChoice {
  uint32_t bin;    // boundary bin: holds the need-th largest entry
  uint32_t above;  // entries in higher bins (of this histogram)
  uint32_t count;  // entries in the boundary bin
};

struct FindBinShared {
  uint32_t warp_sums[kWarps];
  BinChoice choice;
};

// The bin b with  above(b) < need <= above(b) + hist[b],  above(b) = sum of bins > b, read
// from a global histogram that other blocks filled with atomics (so read through L2:
// __ldcg). All threads call it; all get the result. Requires 1 <= need <= sum(hist); if
// that invariant is broken, choice.bin == UINT32_MAX (callers assert).
// Thread t owns the bins [nbins - (t+1)*per, nbins - t*per): thread order = descending bins,
// so an inclusive scan over threads is a count "from the top".
__device__ __forceinline__ BinChoice block_find_bin(const uint32_t* hist, int nbins, uint32_t need,
                                                    FindBinShared* sh) {
  const int per = (nbins + kThreads - 1) / kThreads;
  const int hi = nbins - static_cast<int>(threadIdx.x) * per;
  const int lo = hi - per > 0 ? hi - per : 0;
  uint32_t sum = 0;
  for (int b = lo; b < hi; ++b) sum += __ldcg(hist + b);
  if (threadIdx.x == 0) sh->choice = BinChoice{UINT32_MAX, 0, 0};
  const uint32_t inclusive = block_inclusive_scan(sum, sh->warp_sums);  // has __syncthreads
  const uint32_t exclusive = inclusive - sum;
  if (exclusive < need && need <= inclusive) {  // exactly one thread (sum > 0 there)
    uint32_t seen = exclusive;
    for (int b = hi - 1; b >= lo; --b) {
      const uint32_t c = __ldcg(hist + b);
      if (seen + c >= need) {
        sh->choice = BinChoice{static_cast<uint32_t>(b), seen, c};
        break;
      }
      seen += c;
    }
  }
  __syncthreads();
  const BinChoice choice = sh->choice;
  __syncthreads();
  return choice;
}

// ---------------------------------------------------------------------------------------
// Decoupled look-back: exclusive prefix of per-tile counts in one pass, in tile order.
// ---------------------------------------------------------------------------------------
//
// status[tile] (zeroed before the launch) is one 64-bit word: 2 flag bits (0 = nothing yet,
// kAggregate = the tile's own count, kPrefix = the inclusive prefix up to this tile) and a
// 62-bit value holding two packed 31-bit counts (pack2). One word per tile => flag and
// value are read and written together, so relaxed atomics suffice. Counts never exceed
// n <= 2^31 - 1, so the packed sums never carry from one field into the other.
//
// Forward progress: tiles are handed out by an atomic ticket (not blockIdx), so the tile
// a block waits for was taken earlier by a block that is already running (and holds it
// until it has published); waits only go to lower tiles, hence no deadlock whatever the
// scheduling or grid size.

constexpr uint64_t kLookbackAggregate = 1ull << 62;
constexpr uint64_t kLookbackPrefix = 2ull << 62;
constexpr uint64_t kLookbackValue = (1ull << 62) - 1;

__device__ __forceinline__ uint64_t pack2(uint32_t a, uint32_t b) {
  return static_cast<uint64_t>(a) | (static_cast<uint64_t>(b) << 31);
}
__device__ __forceinline__ uint32_t unpack_first(uint64_t v) {
  return static_cast<uint32_t>(v & 0x7FFFFFFFull);
}
__device__ __forceinline__ uint32_t unpack_second(uint64_t v) {
  return static_cast<uint32_t>((v >> 31) & 0x7FFFFFFFull);
}

__device__ __forceinline__ uint64_t load_relaxed(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

// Called by all 32 lanes of one warp per tile. Returns (in every lane) the packed sum of the
// aggregates of tiles 0 .. tile-1 and publishes this tile's inclusive prefix.
// Warp-wide look-back (as CUB's): lane l inspects tile  top - l  of a window of 32
// predecessors; once no lane sees "nothing yet", the lanes up to the nearest inclusive
// prefix contribute; without a prefix in the window, all 32 aggregates are added and the
// window moves 32 tiles down. A single-thread walk would resolve one predecessor per L2
// round trip and cap the pass far below HBM bandwidth.
__device__ __forceinline__ uint64_t lookback_exclusive(uint64_t* status, uint32_t tile, uint64_t aggregate) {
  const uint32_t lane = lane_id();
  if (tile == 0) {
    if (lane == 0) store_relaxed(status, kLookbackPrefix | aggregate);
    return 0;
  }
  if (lane == 0) store_relaxed(status + tile, kLookbackAggregate | aggregate);
  uint64_t exclusive = 0;
  int64_t top = static_cast<int64_t>(tile) - 1;
  for (;;) {
    const int64_t j = top - static_cast<int64_t>(lane);
    uint64_t s;
    for (;;) {
      // Below tile 0 there is nothing to add; tile 0 always ends a walk with its prefix.
      s = j >= 0 ? load_relaxed(status + j) : kLookbackPrefix;
      if (!__any_sync(kFullMask, (s & ~kLookbackValue) == 0)) break;
      __nanosleep(32);  // a predecessor has not published yet
    }
    const uint32_t prefixes = __ballot_sync(kFullMask, (s & ~kLookbackValue) == kLookbackPrefix);
    // The nearest prefix is the lowest lane with one; lanes below it hold aggregates.
    const bool contributes = prefixes == 0 || lane <= static_cast<uint32_t>(__ffs(prefixes) - 1);
    exclusive += warp_sum(contributes ? (s & kLookbackValue) : 0ull);
    if (prefixes != 0) break;
    top -= 32;
  }
  if (lane == 0) store_relaxed(status + tile, kLookbackPrefix | (exclusive + aggregate));
  return exclusive;
}

// ---------------------------------------------------------------------------------------
// Tile ranking: payload slots in index order for up to two categories of selected entries.
// ---------------------------------------------------------------------------------------
//
// Each thread holds a bit mask per category (bit j = its entry j is selected). rank() gives
// the tile's exclusive prefix (look-back) and per (category, j, warp) offsets; slot() then
// gives every selected entry its global position:
//   base[c] + offsets[c][j][warp] + popc(ballot_j & lanemask_lt)
// which is the number of selected entries (category c) with a lower index in the domain.
template <int NCAT>
struct TileRankShared {
  uint32_t offsets[NCAT][kItems][kWarps];  // per row j and warp: exclusive offset in the tile
  uint32_t aggregate[2];
  uint32_t base[2];       // exclusive prefix of the tile (from the look-back)
  uint32_t inclusive[2];  // base + aggregate
  uint32_t tile;          // current tile (ticket broadcast)
};

template <int NCAT>
__device__ __forceinline__ void tile_rank(const uint32_t (&mask)[NCAT], uint32_t tile, uint64_t* status,
                                          TileRankShared<NCAT>* sh) {
  static_assert(NCAT == 1 || NCAT == 2, "one or two categories");
  const uint32_t warp = warp_id();
#pragma unroll
  for (int c = 0; c < NCAT; ++c) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const uint32_t ballot = __ballot_sync(kFullMask, (mask[c] >> j) & 1u);
      if (lane_id() == 0) sh->offsets[c][j][warp] = __popc(ballot);
    }
  }
  __syncthreads();
  // Warp c scans the kItems * kWarps = 128 counts of category c, in (j, warp) order.
  if (warp < static_cast<uint32_t>(NCAT)) {
    constexpr int kPerLane = kItems * kWarps / 32;  // 4
    uint32_t* counts = &sh->offsets[warp][0][0];
    uint32_t local[kPerLane];
    uint32_t sum = 0;
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      local[q] = counts[lane_id() * kPerLane + q];
      sum += local[q];
    }
    const uint32_t inclusive = warp_inclusive_scan(sum);
    uint32_t running = inclusive - sum;
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      counts[lane_id() * kPerLane + q] = running;
      running += local[q];
    }
    if (lane_id() == 31) sh->aggregate[warp] = inclusive;
  }
  __syncthreads();
  if (warp == 0) {
    const uint32_t a0 = sh->aggregate[0];
    const uint32_t a1 = NCAT == 2 ? sh->aggregate[1] : 0u;
    const uint64_t exclusive = lookback_exclusive(status, tile, pack2(a0, a1));
    if (lane_id() == 0) {
      sh->base[0] = unpack_first(exclusive);
      sh->base[1] = unpack_second(exclusive);
      sh->inclusive[0] = sh->base[0] + a0;
      sh->inclusive[1] = sh->base[1] + a1;
    }
  }
  __syncthreads();
}

// Global slot of this thread's entry j of category c (valid only if selected).
template <int NCAT>
__device__ __forceinline__ uint32_t tile_slot(const TileRankShared<NCAT>* sh, int c, int j, uint32_t ballot) {
  return sh->base[c] + sh->offsets[c][j][warp_id()] + __popc(ballot & lanemask_lt());
}

// Takes the next tile of a look-back pass (thread 0), broadcast to the block.
template <int NCAT>
__device__ __forceinline__ uint32_t next_tile(uint32_t* counter, TileRankShared<NCAT>* sh) {
  __syncthreads();  // everybody is done with the previous tile's shared state
  if (threadIdx.x == 0) sh->tile = atomicAdd(counter, 1u);
  __syncthreads();
  return sh->tile;
}

}  // namespace sparsecomm_cuda
