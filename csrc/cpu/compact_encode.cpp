// chunk_encode of a layout with a scale_group on CPU: exact top-k on the compact wire.
//
// Bit for bit what ChunkLayout(numel, numel, density, codecs, scale_group).encode writes
// (sparsecomm/compress/chunk_layout.py) for acc = compensated(grad, residual, divisor,
// add_residual): the bucket is one chunk, its top k entries by magnitude key (ties: lower
// index) are listed in ascending index order, and every scale_group consecutive payload
// entries share a bf16 scale.
//
//   1. Selection: exact_topk.h, as ef_topk_pack (one streaming pass that forms acc and
//      leaves it in the residual, then exact radix selection among ~1.5k candidates), with
//      SentResidual::acc: the sent entries keep acc for now, since their residual, acc -
//      decoded, needs the scale of their group, known only once the selection is.
//   2. Payload order: the sampled strategy lists the entries in index order already; the
//      two-pass one in two ascending runs, which are merged.
//   3. Blocks of payload entries, a multiple of scale_group and of 8 entries (so that every
//      block starts on a byte of every region), in parallel: each group's scale, then per
//      entry its code, decoded value, index and value fields, and its residual.
//   4. Rice indices: a block's codes start after the bits of all earlier blocks' codes: their
//      widths are summed first (a scan over blocks), then every block writes its codes from
//      its first bit; the byte a block shares with the one before it is ORed in afterwards.
//
// Memory traffic: step 1's (read grad and residual, write the residual: the read-read-write
// floor) plus k scattered residual writes; the result does not depend on the thread count.
#include "chunk_codecs.h"
#include "exact_topk.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

struct CompactWorkspace {
  std::vector<int32_t> index, merged_index;
  std::vector<float> value, merged_value;
  std::vector<int64_t> block_bits;  // Rice: bits of every block's codes, then their prefix sums
  std::vector<uint16_t> block_head;
};

CompactWorkspace& compact_workspace() {
  static thread_local CompactWorkspace ws;  // only the calling thread uses it; grows, then reused
  return ws;
}

// A BitWriter (chunk_codecs.h) that starts at any bit of a region: the byte it shares with
// the writer before it (when `bit` is not a multiple of 8) is not written but kept in head(),
// for the caller to OR in once both writers are done. So writers of adjacent bit ranges can
// run in parallel.
class UnalignedBitWriter {
 public:
  UnalignedBitWriter(uint8_t* region, int64_t bit)
      : out_(region + bit / 8), filled_(static_cast<int>(bit % 8)), shared_(bit % 8 != 0) {}
  // bits <= 32; value < 2^bits.
  void put(uint64_t value, int bits) {
    buffer_ |= value << filled_;
    filled_ += bits;
    if (filled_ >= 32) {
      store_word(static_cast<uint32_t>(buffer_));
      buffer_ >>= 32;
      filled_ -= 32;
    }
  }
  void put_ones(int64_t count) {
    for (; count >= 32; count -= 32) put(0xFFFFFFFFu, 32);
    if (count) put((uint64_t{1} << count) - 1, static_cast<int>(count));
  }
  // Writes the partial last bytes.
  void finish() {
    for (; filled_ > 0; filled_ -= 8) {
      store_byte(static_cast<uint8_t>(buffer_));
      buffer_ >>= 8;
    }
    filled_ = 0;
  }
  uint8_t head() const { return head_; }

 private:
  void store_word(uint32_t word) {
    if (__builtin_expect(shared_, 0)) {
      for (int b = 0; b < 4; ++b) store_byte(static_cast<uint8_t>(word >> (8 * b)));
      return;
    }
    std::memcpy(out_, &word, 4);
    out_ += 4;
  }
  void store_byte(uint8_t byte) {
    if (shared_) {
      head_ = byte;
      shared_ = false;
    } else {
      *out_ = byte;
    }
    ++out_;
  }

  uint8_t* out_;
  uint64_t buffer_ = 0;
  int filled_;
  bool shared_;
  uint8_t head_ = 0;
};

// One Rice code: `quotient` one-bits, a zero, the r low bits of the gap.
template <typename Writer>
inline void put_rice(Writer& writer, uint32_t gap, int r) {
  const int64_t quotient = gap >> r;
  const uint64_t low = gap & ((uint64_t{1} << r) - 1);
  if (quotient + 1 + r <= 32) {
    writer.put(((uint64_t{1} << quotient) - 1) | (low << (quotient + 1)), static_cast<int>(quotient + 1 + r));
  } else {
    writer.put_ones(quotient);
    writer.put(low << 1, 1 + r);
  }
}

struct Outputs {
  uint8_t* payload;
  int64_t* indices;
  void* decoded;  // float32 for scaled codecs and fp32, 16-bit wire values for bf16/fp16
  float* residual;
};

// Step 3 over payload entries [e0, e1) (e0 a multiple of the group and of 8 entries).
void emit_block(const ChunkFormat& f, const int32_t* index, const float* value, int64_t e0, int64_t e1,
                const Outputs& out) {
  constexpr int64_t kPrefetchDistance = 32;  // residual writes are scattered: overlap the misses
  BitWriter value_bits(out.payload + f.value_start + e0 * f.value_bits / 8);
  BitWriter index_bits(out.payload + f.index_start + e0 * f.index_bits / 8);  // the chunk codec's
  for (int64_t g0 = e0; g0 < e1; g0 += f.scale_group) {
    const int64_t g1 = std::min(g0 + f.scale_group, e1);
    float scale = 0.0f;
    if (f.scaled) {
      scale = chunk_scale(f.value_codec, value + g0, g1 - g0);
      const uint16_t bits = static_cast<uint16_t>(float_bits(scale) >> 16);
      std::memcpy(out.payload + 2 * (g0 / f.scale_group), &bits, 2);
    }
    for (int64_t e = g0; e < g1; ++e) {
      if (out.residual != nullptr && e + kPrefetchDistance < e1) {
        __builtin_prefetch(out.residual + index[e + kPrefetchDistance], 1);
      }
      const float v = value[e];
      const int32_t i = index[e];
      uint32_t code;
      float decoded;
      if (f.scaled) {
        code = value_code(f.value_codec, v, scale);
        decoded = decode_code(f.value_codec, code, scale);
        static_cast<float*>(out.decoded)[e] = decoded;
      } else {
        code = float_wire_bits(f.value_codec, v);
        decoded = float_wire_value(f.value_codec, code);
        if (f.value_codec == kValueFp32) {
          std::memcpy(static_cast<float*>(out.decoded) + e, &code, 4);
        } else {
          static_cast<uint16_t*>(out.decoded)[e] = static_cast<uint16_t>(code);
        }
      }
      value_bits.put(code, f.value_bits);
      if (f.index_codec == kIndexInt32) {
        std::memcpy(out.payload + f.index_start + 4 * e, &i, 4);
      } else if (f.index_codec == kIndexChunk) {
        index_bits.put(static_cast<uint32_t>(i), f.index_bits);
      }
      out.indices[e] = i;
      // The residual held acc here (step 1). A non-finite acc leaves +0; a non-finite
      // decoded value (a group with an Inf/NaN) sends nothing usable, so acc stays.
      if (out.residual != nullptr) {
        out.residual[i] = !std::isfinite(v) ? 0.0f : std::isfinite(decoded) ? v - decoded : v;
      }
    }
  }
  value_bits.finish();
  if (f.index_codec == kIndexChunk) index_bits.finish();
}

// Step 4: the Rice index region, blocks of `per_block` entries in parallel.
void write_rice(const ChunkFormat& f, const int32_t* index, int64_t per_block, int64_t blocks, uint8_t* payload,
                CompactWorkspace& ws) {
  const int r = f.rice_r_full;
  const int64_t k = f.selected;
  auto gap = [&](int64_t e) { return static_cast<uint32_t>(index[e] - (e > 0 ? index[e - 1] : -1) - 1); };
  ws.block_bits.assign(blocks + 1, 0);
  ws.block_head.assign(blocks, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      int64_t bits = 0;
      for (int64_t e = b * per_block, end = std::min(e + per_block, k); e < end; ++e) bits += (gap(e) >> r) + 1 + r;
      ws.block_bits[b + 1] = bits;
    }
  });
  for (int64_t b = 0; b < blocks; ++b) ws.block_bits[b + 1] += ws.block_bits[b];  // first bit of every block
  const int64_t total = ws.block_bits[blocks];
  TORCH_INTERNAL_ASSERT(total <= f.rice_bits_full, "chunk_encode: Rice codes take ", total, " bits, more than the ",
                        f.rice_bits_full, " of the layout");
  uint8_t* region = payload + f.index_start;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      UnalignedBitWriter writer(region, ws.block_bits[b]);
      for (int64_t e = b * per_block, end = std::min(e + per_block, k); e < end; ++e) put_rice(writer, gap(e), r);
      writer.finish();
      ws.block_head[b] = writer.head();
    }
  });
  for (int64_t b = 0; b < blocks; ++b) {
    if (ws.block_bits[b] % 8 != 0) region[ws.block_bits[b] / 8] |= static_cast<uint8_t>(ws.block_head[b]);
  }
  // The zero padding up to the layout's bits (the worst case), and the region's last byte.
  const int64_t written = (total + 7) / 8, region_bytes = f.value_start - f.index_start;
  std::memset(region + written, 0, region_bytes - written);
}

// Merges the ascending runs [0, split) and [split, k) of (index, value) into ws.merged_*.
void merge_runs(CompactWorkspace& ws, int64_t split, int64_t k) {
  ws.merged_index.resize(k);
  ws.merged_value.resize(k);
  const int32_t* index = ws.index.data();
  const float* value = ws.value.data();
  int64_t a = 0, b = split;
  for (int64_t m = 0; m < k; ++m) {
    const bool take_a = b == k || (a < split && index[a] < index[b]);
    const int64_t from = take_a ? a++ : b++;
    ws.merged_index[m] = index[from];
    ws.merged_value[m] = value[from];
  }
}

}  // namespace

// Arguments checked by the caller (dispatch/cpu_ops.cpp): grad float32, residual float32
// of grad's size (or none), payload uint8 of f.nbytes, indices int64 and decoded of
// f.selected entries; f.scale_group > 0, so the bucket is one chunk.
void compact_encode(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, float divisor,
                    bool add_residual, const ChunkFormat& f, const at::Tensor& payload, const at::Tensor& indices,
                    const at::Tensor& decoded) {
  const int64_t n = f.numel, k = f.selected;
  const Outputs out{payload.mutable_data_ptr<uint8_t>(), indices.mutable_data_ptr<int64_t>(), decoded.data_ptr(),
                    residual.has_value() ? residual->mutable_data_ptr<float>() : nullptr};
  CompactWorkspace& ws = compact_workspace();
  ws.index.resize(k);
  ws.value.resize(k);
  // Step 1 (V = float: the values are acc itself).
  const int64_t ascending = exact_topk<float, float, SentResidual::acc>(
      grad.const_data_ptr<float>(), out.residual, divisor, add_residual, n, k, ws.index.data(), ws.value.data(), 0);
  // Step 2.
  const int32_t* index = ws.index.data();
  const float* value = ws.value.data();
  if (ascending < k) {
    merge_runs(ws, ascending, k);
    index = ws.merged_index.data();
    value = ws.merged_value.data();
  }
  // Step 3: blocks of a whole number of units (a unit: a multiple of the group and of 8
  // entries), a few per thread.
  const int64_t unit = std::lcm<int64_t>(f.scale_group, 8);
  const int64_t units = (k + unit - 1) / unit;
  const int64_t wanted = std::max<int64_t>(1, 4 * at::get_num_threads());
  const int64_t per_block = (units + wanted - 1) / wanted * unit;
  const int64_t blocks = (k + per_block - 1) / per_block;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) emit_block(f, index, value, b * per_block, std::min(k, (b + 1) * per_block), out);
  });
  // Step 4.
  if (f.index_codec == kIndexRice) write_rice(f, index, per_block, blocks, out.payload, ws);
  std::memset(out.payload + f.value_end, 0, f.nbytes - f.value_end);
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
