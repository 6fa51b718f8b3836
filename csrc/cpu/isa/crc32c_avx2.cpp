// crc32c for CPUs with AVX2, whose level includes SSE4.2 (see compile_level.h).
#define SPARSECOMM_CPU_LEVEL SPARSECOMM_CPU_AVX2
#define SPARSECOMM_CPU_KERNEL "../crc32c.cpp"
#include "compile_level.h"
