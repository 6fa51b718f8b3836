// compact_encode for the baseline instruction set (see compile_level.h).
#define SPARSECOMM_CPU_LEVEL SPARSECOMM_CPU_DEFAULT
#define SPARSECOMM_CPU_KERNEL "../compact_encode.cpp"
#include "compile_level.h"
