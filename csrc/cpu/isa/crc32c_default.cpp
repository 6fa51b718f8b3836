// crc32c for any CPU (see compile_level.h).
#define SPARSECOMM_CPU_LEVEL SPARSECOMM_CPU_DEFAULT
#define SPARSECOMM_CPU_KERNEL "../crc32c.cpp"
#include "compile_level.h"
