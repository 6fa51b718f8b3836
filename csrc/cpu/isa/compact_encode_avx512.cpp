// compact_encode for CPUs with AVX-512 (see compile_level.h).
#define SPARSECOMM_CPU_LEVEL SPARSECOMM_CPU_AVX512
#define SPARSECOMM_CPU_KERNEL "../compact_encode.cpp"
#include "compile_level.h"
