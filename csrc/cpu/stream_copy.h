// Copying a buffer that stays in cache into a bucket that should not: streaming stores.
// Shared by the decoders (chunk_decode_add.cpp, compact_decode_add.cpp), which form a run of
// the bucket in a scratch buffer and then write it out once: the bucket is never read.
#pragma once

#include "magnitude_key.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {

// Copies `bytes` from src to dst; what is 64-byte aligned in dst with streaming stores.
inline void stream_copy(void* dst, const void* src, int64_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
#if defined(__SSE2__)  // x86-64, at every level
  const int64_t head = std::min<int64_t>(bytes, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
  std::memcpy(d, s, head);
  int64_t i = head;
  for (; i + 64 <= bytes; i += 64) {
#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
#elif SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX2
    for (int j = 0; j < 64; j += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + j),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + j)));
    }
#else
    for (int j = 0; j < 64; j += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + j),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + j)));
    }
#endif
  }
  std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(d, s, bytes);
#endif
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
