// CRC-32C of byte rows on CPU: the checksum that seals every sparse payload on the wire
// (sparsecomm/compress/payload_seal.py; the pure-torch twin: sparsecomm/compress/crc32c.py).
//
// CRC-32C (Castagnoli): reflected polynomial 0x82F63B78, initial value and final XOR
// 0xFFFFFFFF. Rows are independent: threads take whole rows (a receiver checks world_size
// payloads at once).
//
// default level: slicing-by-8 (eight 256-entry tables, 8 bytes per step), about 1-2 bytes
// per cycle. avx2 and avx512 levels: the SSE4.2 crc32 instruction (every CPU with AVX2 has
// it; the level's target string names sse4.2, so the run-time check tests it too). One
// crc32 has a latency of 3 cycles and a throughput of 1 per cycle, so a row is cut into
// blocks of 3 x kBlock bytes whose thirds run as three independent streams, then merged:
// crc(A || B) = Z(crc(A)) ^ crc(B), where Z (appending kBlock zero bytes) is a linear map
// over GF(2), applied through four 256-entry tables computed at compile time.
#include "dependencies.h"

#ifndef SPARSECOMM_CPU_NAMESPACE
#error "kernel code is compiled once per CPU level, through isa/compile_level.h"
#endif

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;
constexpr uint32_t kInitial = 0xFFFFFFFFu;

// slice[j][b]: the register after byte b, then j zero bytes, through a zero register.
struct SliceTables {
  uint32_t t[8][256];
};

constexpr SliceTables make_slice_tables() {
  SliceTables s{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) ? kPolynomial : 0u);
    s.t[0][b] = c;
  }
  for (int j = 1; j < 8; ++j) {
    for (int b = 0; b < 256; ++b) s.t[j][b] = (s.t[j - 1][b] >> 8) ^ s.t[0][s.t[j - 1][b] & 0xFFu];
  }
  return s;
}

constexpr SliceTables kSlice = make_slice_tables();

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));  // x86-64 and the other supported hosts are little-endian
  return word;
}

inline uint32_t byte_step(uint32_t crc, uint8_t byte) { return (crc >> 8) ^ kSlice.t[0][(crc ^ byte) & 0xFFu]; }

#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2

constexpr int64_t kBlock = 512;  // bytes per stream of a 3-stream block (a multiple of 8)

// The 32 x 32 bit matrix of "append kBlock zero bytes", as four byte tables.
struct ZerosTables {
  uint32_t t[4][256];
};

constexpr uint32_t apply_columns(const uint32_t (&columns)[32], uint32_t crc) {
  uint32_t out = 0;
  for (int bit = 0; bit < 32; ++bit) {
    if ((crc >> bit) & 1u) out ^= columns[bit];
  }
  return out;
}

constexpr ZerosTables make_zeros_tables() {
  uint32_t columns[32] = {};
  for (int bit = 0; bit < 32; ++bit) {  // one zero byte
    const uint32_t c = 1u << bit;
    columns[bit] = (c >> 8) ^ kSlice.t[0][c & 0xFFu];
  }
  for (int64_t length = 1; length < kBlock; length *= 2) {  // square: 2, 4, ..., kBlock bytes
    uint32_t squared[32] = {};
    for (int bit = 0; bit < 32; ++bit) squared[bit] = apply_columns(columns, columns[bit]);
    for (int bit = 0; bit < 32; ++bit) columns[bit] = squared[bit];
  }
  ZerosTables z{};
  for (int j = 0; j < 4; ++j) {
    for (uint32_t b = 0; b < 256; ++b) z.t[j][b] = apply_columns(columns, b << (8 * j));
  }
  return z;
}

static_assert((kBlock & (kBlock - 1)) == 0, "kBlock: a power of two (the tables square their way to it)");
constexpr ZerosTables kZeros = make_zeros_tables();

inline uint32_t shift_block(uint32_t crc) {
  return kZeros.t[0][crc & 0xFFu] ^ kZeros.t[1][(crc >> 8) & 0xFFu] ^ kZeros.t[2][(crc >> 16) & 0xFFu] ^
         kZeros.t[3][crc >> 24];
}

uint32_t register_after(uint32_t crc, const uint8_t* p, int64_t n) {
  while (n >= 3 * kBlock) {
    uint64_t c0 = crc, c1 = 0, c2 = 0;
    for (int64_t i = 0; i < kBlock; i += 8) {
      c0 = _mm_crc32_u64(c0, load_le64(p + i));
      c1 = _mm_crc32_u64(c1, load_le64(p + kBlock + i));
      c2 = _mm_crc32_u64(c2, load_le64(p + 2 * kBlock + i));
    }
    crc = shift_block(shift_block(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  uint64_t c = crc;
  for (; n >= 8; p += 8, n -= 8) c = _mm_crc32_u64(c, load_le64(p));
  crc = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) crc = _mm_crc32_u8(crc, *p);
  return crc;
}

#else

uint32_t register_after(uint32_t crc, const uint8_t* p, int64_t n) {
  for (; n >= 8; p += 8, n -= 8) {
    const uint64_t word = load_le64(p) ^ crc;
    crc = kSlice.t[7][word & 0xFFu] ^ kSlice.t[6][(word >> 8) & 0xFFu] ^ kSlice.t[5][(word >> 16) & 0xFFu] ^
          kSlice.t[4][(word >> 24) & 0xFFu] ^ kSlice.t[3][(word >> 32) & 0xFFu] ^
          kSlice.t[2][(word >> 40) & 0xFFu] ^ kSlice.t[1][(word >> 48) & 0xFFu] ^ kSlice.t[0][word >> 56];
  }
  for (; n > 0; ++p, --n) crc = byte_step(crc, *p);
  return crc;
}

#endif

}  // namespace

// Arguments checked by the caller (dispatch/cpu_ops.cpp): data uint8 [rows, n] with
// contiguous rows, out int64 [rows].
void crc32c(const at::Tensor& data, const at::Tensor& out) {
  const int64_t rows = data.size(0), n = data.size(1), stride = data.stride(0);
  const uint8_t* base = data.const_data_ptr<uint8_t>();
  int64_t* crc = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      crc[row] = static_cast<int64_t>(register_after(kInitial, base + row * stride, n) ^ kInitial);
    }
  });
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
