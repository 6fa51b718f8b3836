// Choosing the CPU level (cpu_level.h), and the operators that report it.
#include "cpu_level.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <string_view>
#include <tuple>

namespace sparsecomm {
namespace {

constexpr const char* kCapabilityEnv = "SPARSECOMM_CPU_CAPABILITY";

#if SPARSECOMM_CPU_X86_LEVELS
// __builtin_cpu_supports takes only literal names: one case per name in the level targets.
bool cpu_has(std::string_view feature) {
  if (feature == "avx2") return __builtin_cpu_supports("avx2");
  if (feature == "fma") return __builtin_cpu_supports("fma");
  if (feature == "bmi") return __builtin_cpu_supports("bmi");
  if (feature == "bmi2") return __builtin_cpu_supports("bmi2");
  if (feature == "popcnt") return __builtin_cpu_supports("popcnt");
  if (feature == "sse4.2") return __builtin_cpu_supports("sse4.2");
  if (feature == "avx512f") return __builtin_cpu_supports("avx512f");
  if (feature == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (feature == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (feature == "avx512vl") return __builtin_cpu_supports("avx512vl");
  TORCH_INTERNAL_ASSERT(false, "cpu_level.cpp: no run-time check for the target feature '", feature, "'");
}

// The features of a target string ("avx2,fma,...") that the CPU lacks, comma-separated.
std::string missing_features(std::string_view target) {
  __builtin_cpu_init();  // needed before constructors have run; cheap afterwards
  std::string missing;
  while (!target.empty()) {
    const size_t comma = std::min(target.find(','), target.size());
    const std::string_view feature = target.substr(0, comma);
    if (!cpu_has(feature)) missing += (missing.empty() ? "" : ", ") + std::string(feature);
    target.remove_prefix(std::min(comma + 1, target.size()));
  }
  return missing;
}
#endif

// Why the CPU cannot run the level ("" if it can).
std::string unsupported_because(CpuLevel level) {
  switch (level) {
    case CpuLevel::baseline:
      return "";
#if SPARSECOMM_CPU_X86_LEVELS
    case CpuLevel::avx2:
      return missing_features(SPARSECOMM_CPU_AVX2_TARGET);
    case CpuLevel::avx512:
      return missing_features(SPARSECOMM_CPU_AVX512_TARGET);
#endif
    default:
      return "not compiled";
  }
}

std::string join(const std::vector<std::string>& names) {
  std::string joined;
  for (const std::string& name : names) joined += (joined.empty() ? "" : ", ") + name;
  return joined;
}

std::vector<std::string> names(bool supported_only) {
  std::vector<std::string> result;
  for (CpuLevel level : compiled_cpu_levels()) {
    if (!supported_only || cpu_supports(level)) result.emplace_back(cpu_level_name(level));
  }
  return result;
}

CpuLevel choose_cpu_level() {
  const char* value = std::getenv(kCapabilityEnv);
  std::string requested = value ? value : "";
  requested.erase(std::remove_if(requested.begin(), requested.end(), [](unsigned char c) { return std::isspace(c); }),
                  requested.end());
  std::transform(requested.begin(), requested.end(), requested.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const std::vector<CpuLevel> compiled = compiled_cpu_levels();
  if (requested.empty()) {  // the widest one the CPU supports
    CpuLevel widest = CpuLevel::baseline;
    for (CpuLevel level : compiled) {
      if (cpu_supports(level)) widest = level;
    }
    return widest;
  }
  const auto named = std::find_if(compiled.begin(), compiled.end(),
                                  [&](CpuLevel level) { return requested == cpu_level_name(level); });
  TORCH_CHECK(named != compiled.end(), kCapabilityEnv, "=", requested, " names no CPU level of this build (",
              join(names(false)), "); this CPU supports: ", join(names(true)));
  const std::string missing = unsupported_because(*named);
  TORCH_CHECK(missing.empty(), kCapabilityEnv, "=", requested, ": this CPU does not support the ", requested,
              " kernels (it lacks ", missing, "); it supports: ", join(names(true)));
  return *named;
}

std::string cpu_capability_op() { return cpu_level_name(cpu_level()); }

std::tuple<std::vector<std::string>, std::vector<std::string>> cpu_levels_op() {
  return {names(false), names(true)};
}

}  // namespace

const char* cpu_level_name(CpuLevel level) {
  switch (level) {
    case CpuLevel::baseline:
      return "default";
    case CpuLevel::avx2:
      return "avx2";
    case CpuLevel::avx512:
      return "avx512";
  }
  return "unknown";
}

std::vector<CpuLevel> compiled_cpu_levels() {
#if SPARSECOMM_CPU_X86_LEVELS
  return {CpuLevel::baseline, CpuLevel::avx2, CpuLevel::avx512};
#else
  return {CpuLevel::baseline};
#endif
}

bool cpu_supports(CpuLevel level) { return unsupported_because(level).empty(); }

CpuLevel cpu_level() {
  static const CpuLevel level = choose_cpu_level();  // a throw leaves it unset: the next call retries
  return level;
}

// No tensor arguments: CompositeExplicitAutograd serves calls without a dispatch key.
TORCH_LIBRARY_IMPL(sparsecomm, CompositeExplicitAutograd, m) {
  m.impl("cpu_capability", &cpu_capability_op);
  m.impl("cpu_levels", &cpu_levels_op);
}

}  // namespace sparsecomm
