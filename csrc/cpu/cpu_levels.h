// The instruction-set levels the CPU kernels are compiled for.
//
// Every kernel file (csrc/cpu/<op>.cpp) is compiled once per level (isa/<op>_<level>.cpp,
// through isa/compile_level.h), each time into its own namespace sparsecomm::cpu_<level>.
// dispatch/cpu_level.cpp chooses, once per process, the widest level the running CPU
// supports, or the lower one that SPARSECOMM_CPU_CAPABILITY names. So one binary runs on
// any x86-64 CPU and uses AVX-512 where the CPU has it. Every level computes the same bits.
#pragma once

// The wider levels need GCC's `#pragma GCC target` (clang ignores it) and
// __builtin_cpu_supports, on x86-64; other architectures and compilers build only the
// default level.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPARSECOMM_CPU_X86_LEVELS 1
#else
#define SPARSECOMM_CPU_X86_LEVELS 0
#endif

// Values of SPARSECOMM_CPU_LEVEL, the level a kernel file is being compiled for. Kernels
// test it (`#if SPARSECOMM_CPU_LEVEL >= SPARSECOMM_CPU_AVX512`) rather than __AVX512F__ and
// the like: GCC does not define those macros for a `#pragma GCC target` region in C++.
#define SPARSECOMM_CPU_DEFAULT 0  // the compiler's baseline for the architecture (x86-64: SSE2)
#define SPARSECOMM_CPU_AVX2 1
#define SPARSECOMM_CPU_AVX512 2

// The extensions each wider level's code may use, as GCC target names. The run-time check
// (dispatch/cpu_level.cpp) tests these same names, so a level never runs on a CPU that
// lacks one of them. AVX-512: F, BW, DQ, VL, what every AVX-512 CPU since Skylake-SP has.
// SSE4.2 (its crc32 instruction: csrc/cpu/crc32c.cpp) comes with every CPU that has AVX2.
#define SPARSECOMM_CPU_AVX2_TARGET "avx2,fma,bmi,bmi2,popcnt,sse4.2"
#define SPARSECOMM_CPU_AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl," SPARSECOMM_CPU_AVX2_TARGET
