// Fused error feedback + selection by a given threshold + packing on CPU: one pass.
//
// The streaming pass of the sampled top-k strategy (sampled_candidates.h) with the
// threshold as its bound: each of T ranges (T = torch's thread count) computes acc, writes
// it to the residual and appends the entries at or above the threshold to its own slab.
// The slabs are then cut at the capacity in range order (= index order) and emitted; only
// the sent entries' residuals are written again. Entries past the capacity keep acc in the
// residual, so nothing is lost: they are sent on a later step. Counting first and writing
// second would read the bucket twice (about 2x slower).
//
// Non-finite acc (+-Inf, NaN) leaves +0 in the residual, sent or not (csrc/README.md). Sent
// ones get it from sent_remainder; unsent ones (past the capacity, or Inf below a NaN
// threshold) can only be in a range where the pass met an Inf or NaN, and only such a range
// gets a cleanup pass over its residual: on an all-finite step, none.
#include "sampled_candidates.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {
namespace {

Slabs& threshold_slabs() {
  static thread_local Slabs slabs;  // grows to ranges x the largest capacity seen
  return slabs;
}

template <typename T, typename V>
int64_t ef_threshold_pack_impl(const at::Tensor& grad, const c10::optional<at::Tensor>& residual_opt, float divisor,
                               bool add_residual, float threshold, const at::Tensor& indices_out,
                               const at::Tensor& values_out, int64_t index_offset) {
  const int64_t n = grad.numel();
  const int64_t capacity = indices_out.numel();
  const T* g = grad.const_data_ptr<T>();
  T* r = residual_opt.has_value() ? residual_opt->mutable_data_ptr<T>() : nullptr;
  int32_t* out_index = indices_out.mutable_data_ptr<int32_t>();
  V* out_value = values_out.mutable_data_ptr<V>();
  const Collected c = collect_in_ranges<T, V>(g, r, divisor, add_residual, magnitude_key(threshold), n, capacity,
                                              threshold_slabs());
  const int64_t ranges = static_cast<int64_t>(c.lists.size());
  // Take the first `capacity` in index order: a selection that takes the first m_t
  // entries of range t (every key matches the empty prefix).
  Selection first_entries;
  first_entries.take_above.assign(ranges, 0);
  std::vector<int64_t> position(ranges + 1, 0);
  for (int64_t t = 0; t < ranges; ++t) {
    first_entries.take_equal.push_back(std::min(c.lists[t].size, capacity - position[t]));
    position[t + 1] = position[t] + first_entries.take_equal[t];
  }
  at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      emit_selected<T, V>(c.lists[t], first_entries, t, r, out_index, out_value, position[t],
                          static_cast<int32_t>(index_offset), Residual::restore_unsent);
    }
  });
  const int64_t sent = position[ranges];
  const bool met_non_finite =
      std::any_of(c.largest_key.begin(), c.largest_key.end(), [](uint32_t key) { return key >= kInfKey; });
  if (r != nullptr && met_non_finite) {
    at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {  // range t's sent entries: the first take_equal[t] of its slab
        if (c.largest_key[t] < kInfKey) continue;
        zero_unsent_non_finite<T>(r, c.bounds[t], c.bounds[t + 1], c.lists[t].index, first_entries.take_equal[t]);
      }
    });
  }
  std::fill(out_index + sent, out_index + capacity, 0);
  std::fill(out_value + sent, out_value + capacity, static_cast<V>(0.0f));
  return sent;
}

}  // namespace

// Arguments checked by the caller (dispatch/cpu_ops.cpp).
int64_t ef_threshold_pack(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, float divisor,
                          bool add_residual, float threshold, const at::Tensor& indices_out,
                          const at::Tensor& values_out, int64_t index_offset) {
  return SPARSECOMM_DISPATCH_FLOATING(grad.scalar_type(), "ef_threshold_pack", T, [&] {
    return SPARSECOMM_DISPATCH_FLOATING(values_out.scalar_type(), "ef_threshold_pack", V, [&] {
      return ef_threshold_pack_impl<T, V>(grad, residual, divisor, add_residual, threshold, indices_out, values_out,
                                          index_offset);
    });
  });
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
