// Which CPU level's kernels run in this process (the levels: cpu_levels.h).
#pragma once

#include <vector>

#include "../cpu_levels.h"

namespace sparsecomm {

enum class CpuLevel {
  baseline = SPARSECOMM_CPU_DEFAULT,  // named "default" (a C++ keyword)
  avx2 = SPARSECOMM_CPU_AVX2,
  avx512 = SPARSECOMM_CPU_AVX512,
};

// "default", "avx2", "avx512": the names SPARSECOMM_CPU_CAPABILITY takes.
const char* cpu_level_name(CpuLevel level);

// The levels this build has, lowest first.
std::vector<CpuLevel> compiled_cpu_levels();

// Whether the running CPU has every extension the level's code may use.
bool cpu_supports(CpuLevel level);

// The level of this process, chosen on first use and kept: the widest compiled level the
// CPU supports, or the one SPARSECOMM_CPU_CAPABILITY names. Throws (c10::Error) if the
// variable names no level of this build or one the CPU does not support.
CpuLevel cpu_level();

}  // namespace sparsecomm
