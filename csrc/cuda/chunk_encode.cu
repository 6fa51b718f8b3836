// chunk_encode on CUDA (selector="chunk"): fused error feedback + per-chunk exact top-k +
// index and value codecs into one payload, bit for bit what the CPU kernel
// (csrc/cpu/chunk_encode.cpp) and ChunkLayout.encode (sparsecomm/compress/chunk_layout.py)
// write, up to the NaN bits of chunk_codecs.cuh. No host synchronisation.
//
// One thread block (kThreads = 256) per chunk (a grid-stride loop over chunks):
//
//   A. acc = compensate(grad, residual) of the chunk's entries (the two roundings of
//      csrc/README.md). Chunks of up to kCachedChunk entries keep acc in shared memory
//      (dynamic, 4 bytes an entry) and write the residual's provisional value (acc, +0 where
//      acc is not finite) right away; longer chunks (up to 65536) recompute acc from grad and
//      the residual, which stay unchanged until step D, whenever they need it.
//   B. The chunk's k-th largest magnitude key K, exactly: a radix select over the 31 key
//      bits in digits of 8 + 8 + 8 + 7 bits, a shared 256-bin histogram per digit (warp-
//      aggregated atomics: chunks of equal keys or zeros would serialise on one bin). Every
//      level keeps  above < need <= above + hist[bin]  for the digit prefix found so far; at
//      the end `above` entries have a key > K, and `ties = need` (>= 1) of those with key K are
//      taken: the lowest positions (the CPU kernel's and the reference's rule).
//   C. Scaled codecs: the chunk's scale, from the keys >= K (chunk_codecs.cuh ChunkStats:
//      every tie not taken has the magnitude of one that is) by block reductions; thread 0
//      ORs its bf16 bits into the scale region.
//   D. Tiles of kEmitTile = 2048 entries, 8 consecutive entries per thread (thread order is
//      index order): a block scan of the entries with key K gives each its rank among the
//      ties, hence the selection; a scan of the selected counts gives every selected entry
//      its payload slot (ascending index), a max-scan the previous selected position (Rice
//      gaps), a scan of the Rice code widths the code's first bit. Each selected entry writes
//      its index (int64), its index field, its value code, its decoded value and its residual
//      (acc - decoded where that is finite, acc where the decoded value is not, +0 where acc
//      is not finite); the running counts carry from tile to tile.
//
// Payload writes: the payload is zeroed (cudaMemsetAsync) and every field is ORed in with
// 32-bit atomics at word addresses computed from the stream's bit position (chunk_codecs.cuh
// or_bits): sub-byte fields of neighbouring chunks share bytes, and blocks run in any order.
// A payload that is not 4-byte aligned (a view at an odd offset; the caching allocator's are
// 512-byte aligned) is encoded into an aligned scratch buffer and copied.
//
// Cost (not measured: no GPU was available when this was written): step A reads grad (and
// the residual) once and writes the residual once; B..D run from shared memory for chunks up
// to 8192 entries. Longer chunks re-read grad/residual (L2) for each of the 4 radix levels,
// step C and step D. Very short chunks (< 256 entries) leave most of a block idle.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../cpu/dispatch/chunk_checks.h"
#include "chunk_codecs.cuh"

namespace sparsecomm_cuda {
namespace {

using namespace sparsecomm;  // ChunkFormat, codec ids, chunk_format()

constexpr int64_t kCachedChunk = 8192;  // acc in shared memory: 32 KiB (below the 48 KiB default)
constexpr int kLoadBatch = 4;           // step A: entries a thread loads before it computes
constexpr int kEmitItems = 8;           // consecutive entries per thread in step D
constexpr int kEmitTile = kThreads * kEmitItems;
// The 31 key bits as radix digits, most significant first: 8 + 8 + 8 + 7 bits.
constexpr int kDigits = 4;
__host__ __device__ constexpr int digit_shift(int level) { return level == 0 ? 23 : level == 1 ? 15 : level == 2 ? 7 : 0; }
__host__ __device__ constexpr int digit_bits(int level) { return level == kDigits - 1 ? 7 : 8; }
static_assert(digit_shift(kDigits - 1) == 0 && digit_shift(0) + digit_bits(0) == 31, "digits cover the 31 key bits");
constexpr uint32_t kNoBin = 0xFFFFFFFFu;

struct EncodeParams {
  const float* grad;
  float* residual;  // nullptr: none
  bool add_residual;
  float divisor;
  uint32_t* payload;  // 4-byte aligned, zeroed, f.nbytes bytes
  int64_t* indices;   // f.selected
  void* decoded;      // f.selected: float32, or the 16-bit wire values for bf16 / fp16
  ChunkFormat f;
};

struct EncodeShared {
  uint32_t hist[256];
  uint32_t scan_u[kWarps];
  int32_t scan_i[kWarps];
  uint32_t choice[3];  // boundary bin, entries above it, entries in it
};

// acc of the chunk's entry j: from shared memory, or recomputed (grad and residual are not
// written before step D, which reads an entry before it writes it, in the same thread).
template <bool kCached>
__device__ __forceinline__ float acc_at(const EncodeParams& p, const float* cache, int64_t begin, int j) {
  if constexpr (kCached) {
    return cache[j];
  } else {
    const int64_t i = begin + j;
    return p.add_residual ? compensate(p.grad[i], p.residual[i], p.divisor) : compensate(p.grad[i], p.divisor);
  }
}

template <bool kCached>
__global__ void __launch_bounds__(kThreads) chunk_encode_kernel(const EncodeParams p) {
  extern __shared__ float cache[];  // kCached: acc of the current chunk (f.chunk_size floats)
  __shared__ EncodeShared sh;
  const ChunkFormat& f = p.f;
  const int tid = static_cast<int>(threadIdx.x);

  for (int64_t c = blockIdx.x; c < f.chunks; c += gridDim.x) {  // uniform over the block
    const bool last = c == f.chunks - 1;
    const int length = static_cast<int>(last ? f.last_length : f.chunk_size);
    const uint32_t k = static_cast<uint32_t>(last ? f.k_last : f.k_full);
    const int64_t begin = c * f.chunk_size;
    const int64_t first = c * f.k_full;  // payload slot of the chunk's first entry
    __syncthreads();  // the previous chunk is done with the cache and the shared state

    // ---- A: acc (and the provisional residual) -------------------------------------
    if constexpr (kCached) {
      for (int base = 0; base < length; base += kThreads * kLoadBatch) {  // kLoadBatch loads in flight
        float g[kLoadBatch], r[kLoadBatch];
#pragma unroll
        for (int q = 0; q < kLoadBatch; ++q) {
          const int j = base + q * kThreads + tid;
          g[q] = j < length ? p.grad[begin + j] : 0.0f;
          r[q] = j < length && p.add_residual ? p.residual[begin + j] : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < kLoadBatch; ++q) {
          const int j = base + q * kThreads + tid;
          if (j >= length) continue;
          const float a = p.add_residual ? compensate(g[q], r[q], p.divisor) : compensate(g[q], p.divisor);
          cache[j] = a;
          if (p.residual != nullptr) p.residual[begin + j] = float_finite(a) ? a : 0.0f;
        }
      }
      __syncthreads();
    }

    // ---- B: the k-th largest key K and how many ties at K are taken -----------------
    uint32_t prefix = 0, need = k;
    for (int level = 0; level < kDigits; ++level) {
      const int shift = digit_shift(level), bits = digit_bits(level);
      const uint32_t digit_mask = (1u << bits) - 1u;
      sh.hist[tid] = 0;  // kThreads == 256 bins
      __syncthreads();
      for (int base = 0; base < length; base += kThreads) {  // uniform trip count: full warps below
        const int j = base + tid;
        uint32_t bin = kNoBin;
        if (j < length) {
          const uint32_t key = magnitude_key(acc_at<kCached>(p, cache, begin, j));
          if ((key >> (shift + bits)) == prefix) bin = (key >> shift) & digit_mask;  // level 0: key >> 31 == 0
        }
        const uint32_t peers = __match_any_sync(kFullMask, bin);
        if (bin != kNoBin && lane_id() == static_cast<uint32_t>(__ffs(peers) - 1)) {
          atomicAdd(&sh.hist[bin], static_cast<uint32_t>(__popc(peers)));
        }
      }
      __syncthreads();
      // Thread t owns bin 255 - t: the scan counts from the top bin down.
      const int bin = kThreads - 1 - tid;
      const uint32_t count = bin <= static_cast<int>(digit_mask) ? sh.hist[bin] : 0u;
      if (tid == 0) sh.choice[0] = kNoBin;
      uint32_t total;
      const uint32_t higher = block_exclusive_scan(count, 0u, SumOp{}, sh.scan_u, &total);  // barriers
      if (higher < need && need <= higher + count) {  // exactly one thread (count > 0 there)
        sh.choice[0] = static_cast<uint32_t>(bin);
        sh.choice[1] = higher;
        sh.choice[2] = count;
      }
      __syncthreads();
      const uint32_t chosen = sh.choice[0], above_bin = sh.choice[1];
      CUDA_KERNEL_ASSERT(chosen != kNoBin && "chunk_encode: radix level holds fewer than need entries");
      need -= above_bin;
      prefix = (prefix << bits) | chosen;
      // sh.hist and sh.choice are rewritten only after the next level's first barrier.
    }
    const uint32_t kth = prefix, ties = need;

    // ---- C: the chunk's scale -----------------------------------------------------
    float scale = 0.0f;
    if (f.scaled) {  // uniform
      uint32_t largest = 0, smallest = UINT32_MAX, non_finite = 0;
      for (int j = tid; j < length; j += kThreads) {
        const uint32_t key = magnitude_key(acc_at<kCached>(p, cache, begin, j));
        if (key < kth) continue;
        if (key == kNanKey) {
          non_finite = 2;
        } else if (key == kInfKey) {
          non_finite = non_finite > 1u ? non_finite : 1u;
        } else {
          largest = largest < key ? key : largest;
          if (key > 0 && key < smallest) smallest = key;
        }
      }
      ChunkStats stats;
      stats.largest = block_reduce(largest, 0u, MaxOp{}, sh.scan_u);
      stats.smallest = block_reduce(smallest, UINT32_MAX, MinOp{}, sh.scan_u);
      stats.non_finite = block_reduce(non_finite, 0u, MaxOp{}, sh.scan_u);
      scale = chunk_scale(f.value_codec, stats);
      if (tid == 0) or_bits(p.payload, 16 * c, __float_as_uint(scale) >> 16);
    }

    // ---- D: selection, slots, codes, residual --------------------------------------
    const bool rice = f.index_codec == kIndexRice;
    const int r = static_cast<int>(last ? f.rice_r_last : f.rice_r_full);
    const uint32_t low_mask = (1u << r) - 1u;
    const int64_t index_bit0 = 8 * f.index_start, value_bit0 = 8 * f.value_start;
    const int64_t rice_bit0 = index_bit0 + c * f.rice_bits_full;  // the chunk's first Rice bit
    uint32_t ties_seen = 0, slots_done = 0, rice_done = 0;
    int32_t previous = -1;  // last selected position of the earlier tiles
    for (int tile = 0; tile < length; tile += kEmitTile) {  // uniform
      const int j0 = tile + tid * kEmitItems;
      float a[kEmitItems];
      uint32_t key[kEmitItems];
      uint32_t at_kth = 0;
#pragma unroll
      for (int q = 0; q < kEmitItems; ++q) {
        const int j = j0 + q;
        a[q] = 0.0f;
        key[q] = 0;
        if (j < length) {
          a[q] = acc_at<kCached>(p, cache, begin, j);
          key[q] = magnitude_key(a[q]);
          at_kth += key[q] == kth;
        }
      }
      uint32_t tie_total;
      uint32_t tie_rank = ties_seen + block_exclusive_scan(at_kth, 0u, SumOp{}, sh.scan_u, &tie_total);
      uint32_t selected = 0;  // bit q: entry j0 + q is sent
      int32_t last_here = -1;
#pragma unroll
      for (int q = 0; q < kEmitItems; ++q) {
        if (j0 + q >= length) continue;
        bool take = key[q] > kth;
        if (key[q] == kth) {
          take = tie_rank < ties;
          ++tie_rank;
        }
        if (take) {
          selected |= 1u << q;
          last_here = j0 + q;
        }
      }
      uint32_t count_total;
      const uint32_t slot0 =
          slots_done + block_exclusive_scan(static_cast<uint32_t>(__popc(selected)), 0u, SumOp{}, sh.scan_u,
                                            &count_total);
      int32_t last_total;
      const int32_t before = block_exclusive_scan(last_here, int32_t{-1}, MaxOp{}, sh.scan_i, &last_total);
      const int32_t previous_here = before > previous ? before : previous;
      uint32_t rice_here = 0;  // bits of this thread's Rice codes, and the first one's offset
      if (rice) {  // uniform
        int32_t prev = previous_here;
#pragma unroll
        for (int q = 0; q < kEmitItems; ++q) {
          if ((selected >> q) & 1u) {
            const uint32_t gap = static_cast<uint32_t>(j0 + q - prev - 1);
            rice_here += (gap >> r) + 1u + static_cast<uint32_t>(r);
            prev = j0 + q;
          }
        }
        uint32_t rice_total;
        rice_here = rice_done + block_exclusive_scan(rice_here, 0u, SumOp{}, sh.scan_u, &rice_total);
        rice_done += rice_total;
      }

      int32_t prev = previous_here;
      uint32_t slot = slot0;
#pragma unroll
      for (int q = 0; q < kEmitItems; ++q) {
        const int j = j0 + q;
        if (j >= length) continue;
        const int64_t i = begin + j;
        if (!((selected >> q) & 1u)) {
          if (!kCached && p.residual != nullptr) p.residual[i] = float_finite(a[q]) ? a[q] : 0.0f;
          continue;
        }
        const int64_t e = first + slot;  // payload entry
        p.indices[e] = i;
        // Index region.
        if (f.index_codec == kIndexInt32) {
          or_bits(p.payload, index_bit0 + 32 * e, static_cast<uint32_t>(i));
        } else if (f.index_codec == kIndexChunk) {
          or_bits(p.payload, index_bit0 + static_cast<int64_t>(f.index_bits) * e, static_cast<uint32_t>(j));
        } else {
          const uint32_t gap = static_cast<uint32_t>(j - prev - 1);
          const uint32_t quotient = gap >> r;
          const int64_t start = rice_bit0 + rice_here;
          or_ones(p.payload, start, quotient);  // then the zero bit, then the r low bits
          if (r > 0) or_bits(p.payload, start + quotient + 1, gap & low_mask);
          rice_here += quotient + 1u + static_cast<uint32_t>(r);
          prev = j;
        }
        // Value region, decoded value, residual.
        const float v = a[q];
        uint32_t code;
        float decoded;
        if (f.scaled) {
          code = value_code(f.value_codec, v, scale);
          decoded = decode_code(f.value_codec, code, scale);
          static_cast<float*>(p.decoded)[e] = decoded;
        } else {
          code = float_wire_bits(f.value_codec, v);
          decoded = float_wire_value(f.value_codec, code);
          if (f.value_codec == kValueFp32) {
            static_cast<uint32_t*>(p.decoded)[e] = code;
          } else {
            static_cast<uint16_t*>(p.decoded)[e] = static_cast<uint16_t>(code);
          }
        }
        or_bits(p.payload, value_bit0 + static_cast<int64_t>(f.value_bits) * e, code);
        if (p.residual != nullptr) {
          p.residual[i] = !float_finite(v) ? 0.0f : (float_finite(decoded) ? __fsub_rn(v, decoded) : v);
        }
        ++slot;
      }
      ties_seen += tie_total;
      slots_done += count_total;
      previous = last_total > previous ? last_total : previous;
    }
    if (tid == 0) {
      CUDA_KERNEL_ASSERT(slots_done == k && "chunk_encode: a chunk did not send exactly k entries");
      CUDA_KERNEL_ASSERT((!rice || rice_done <= static_cast<uint32_t>(last ? f.rice_bits_last : f.rice_bits_full)) &&
                         "chunk_encode: Rice codes exceed the chunk's bits");
    }
  }
}

// The CPU operator's checks (csrc/cpu/dispatch/chunk_checks.h), and that grad is a CUDA tensor
// (the others are checked to be on its device).
std::tuple<at::Tensor, at::Tensor> chunk_encode_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                                                     double divisor, bool add_residual, int64_t chunk_size,
                                                     int64_t k_full, int64_t k_last, int64_t index_codec,
                                                     int64_t value_codec, int64_t scale_group,
                                                     const at::Tensor& payload) {
  TORCH_CHECK(grad.is_cuda(), "chunk_encode: grad must be a CUDA tensor");
  const ChunkFormat f = check_chunk_encode(grad, residual, divisor, add_residual, chunk_size, k_full, k_last,
                                           index_codec, value_codec, scale_group, payload);
  // sparsecomm/ops/dispatch.py sends such layouts elsewhere (csrc/README.md).
  TORCH_CHECK(f.scale_group == 0, "chunk_encode: the CUDA kernel takes no scale_group (got ", f.scale_group, ")");

  const c10::cuda::CUDAGuard device_guard(grad.device());
  const at::ScalarType decoded_dtype = chunk_decoded_dtype(value_codec);
  at::Tensor indices = at::empty({f.selected}, grad.options().dtype(at::kLong));
  at::Tensor decoded = at::empty({f.selected}, grad.options().dtype(decoded_dtype));
  const bool aligned = reinterpret_cast<uintptr_t>(payload.data_ptr()) % 4 == 0;
  at::Tensor target = aligned ? payload : at::empty({f.nbytes}, payload.options());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(target.data_ptr(), 0, static_cast<size_t>(f.nbytes), stream));

  EncodeParams params;
  params.grad = grad.const_data_ptr<float>();
  params.residual = residual.has_value() ? residual->mutable_data_ptr<float>() : nullptr;
  params.add_residual = add_residual;
  params.divisor = static_cast<float>(divisor);  // float(divisor), as the contract
  params.payload = static_cast<uint32_t*>(target.data_ptr());
  params.indices = indices.mutable_data_ptr<int64_t>();
  params.decoded = decoded.data_ptr();
  params.f = f;
  const int grid = static_cast<int>(std::min<int64_t>(f.chunks, static_cast<int64_t>(multiprocessor_count()) * 8));
  if (f.chunk_size <= kCachedChunk) {
    const size_t shared_bytes = static_cast<size_t>(f.chunk_size) * sizeof(float);
    chunk_encode_kernel<true><<<grid, kThreads, shared_bytes, stream>>>(params);
  } else {
    chunk_encode_kernel<false><<<grid, kThreads, 0, stream>>>(params);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!aligned) payload.copy_(target);
  return {indices, decoded};
}

}  // namespace
}  // namespace sparsecomm_cuda

TORCH_LIBRARY_IMPL(sparsecomm, CUDA, m) {
  m.impl("chunk_encode", &sparsecomm_cuda::chunk_encode_cuda);
}
