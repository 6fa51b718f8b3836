// Compiles one kernel file for one CPU level (cpu_levels.h). Included by the translation
// unit <op>_<level>.cpp that setup.py writes for every kernel file and level (into the
// build's temporary folder; write_cpu_level_units), which first defines SPARSECOMM_CPU_LEVEL
// (a level) and SPARSECOMM_CPU_KERNEL (the kernel file, relative to this directory).
//
// The headers from outside sparsecomm (dependencies.h) come first, before the switch to the
// level's instruction set: their inline functions and templates exist, under the same
// names, in every level's object, and the linker keeps one copy of each; compiled for the
// baseline, any copy runs on any CPU. Only code defined inside the `#pragma GCC target`
// region takes the level's instructions: the kernel's own, all in sparsecomm::cpu_<level>,
// so no name is shared between levels. Templates from outside that the kernel instantiates
// (std::vector, at::parallel_for, ...) stay baseline code (GCC attaches the target to a
// function where it is declared); they inline into the level's code all the same.
//
// Without FMA contraction (setup.py passes -ffp-contract=off) every level rounds alike: the
// kernels are bit-exact against sparsecomm/ops/reference.py at every level.
#include "../cpu_levels.h"

#if !defined(SPARSECOMM_CPU_LEVEL) || !defined(SPARSECOMM_CPU_KERNEL)
#error "define SPARSECOMM_CPU_LEVEL and SPARSECOMM_CPU_KERNEL before including compile_level.h"
#endif

#if SPARSECOMM_CPU_LEVEL == SPARSECOMM_CPU_DEFAULT || SPARSECOMM_CPU_X86_LEVELS

#include "../dependencies.h"
#include "../kernels.h"

#define SPARSECOMM_CPU_PRAGMA(text) _Pragma(#text)
#define SPARSECOMM_CPU_TARGET(features) SPARSECOMM_CPU_PRAGMA(GCC target(features))

#if SPARSECOMM_CPU_LEVEL == SPARSECOMM_CPU_DEFAULT
#define SPARSECOMM_CPU_NAMESPACE cpu_default
#include SPARSECOMM_CPU_KERNEL
#elif SPARSECOMM_CPU_LEVEL == SPARSECOMM_CPU_AVX2
#define SPARSECOMM_CPU_NAMESPACE cpu_avx2
#pragma GCC push_options
SPARSECOMM_CPU_TARGET(SPARSECOMM_CPU_AVX2_TARGET)
#include SPARSECOMM_CPU_KERNEL
#pragma GCC pop_options
#elif SPARSECOMM_CPU_LEVEL == SPARSECOMM_CPU_AVX512
#define SPARSECOMM_CPU_NAMESPACE cpu_avx512
#pragma GCC push_options
SPARSECOMM_CPU_TARGET(SPARSECOMM_CPU_AVX512_TARGET)
#include SPARSECOMM_CPU_KERNEL
#pragma GCC pop_options
#else
#error "unknown SPARSECOMM_CPU_LEVEL"
#endif

#endif  // a level this build has
