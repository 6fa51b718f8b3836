// Every header from outside sparsecomm that the CPU kernels use, and nothing else.
//
// isa/compile_level.h includes this before it switches the compiler to a level's
// instruction set, so that the inline functions and templates of these headers are
// compiled for the baseline in every level's object. A header the kernels need belongs
// here, not in a kernel file: included there, its code would take the level's
// instructions, and the one copy the linker keeps of it could be the AVX-512 one.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>  // GCC declares every intrinsic; a level may use those of its target
#endif
