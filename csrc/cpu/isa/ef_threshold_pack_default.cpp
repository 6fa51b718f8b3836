// ef_threshold_pack for the baseline instruction set (see compile_level.h).
#define SPARSECOMM_CPU_LEVEL SPARSECOMM_CPU_DEFAULT
#define SPARSECOMM_CPU_KERNEL "../ef_threshold_pack.cpp"
#include "compile_level.h"
