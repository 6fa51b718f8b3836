// compact_encode for CPUs with AVX2 (see compile_level.h).
#define SPARSECOMM_CPU_LEVEL SPARSECOMM_CPU_AVX2
#define SPARSECOMM_CPU_KERNEL "../compact_encode.cpp"
#include "compile_level.h"
