// Fused error feedback + selection by a given threshold + packing on CPU: one pass.
//
// Each of T ranges (T = torch's thread count) writes its selected entries to its own
// slab of `capacity` entries while it streams through grad and residual; the slabs are
// then concatenated in range order (= index order) and cut at the capacity. Entries cut
// off are put back into the residual, so nothing is lost: they are sent on a later step.
// Counting first and writing second would read the bucket twice (about 2x slower).
#include "magnitude_key.h"

namespace sparsecomm {
namespace {

struct Slabs {
  std::vector<int32_t> index;
  std::vector<float> value;
};

Slabs& slabs() {
  static thread_local Slabs s;
  return s;
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
  const uint32_t bar = magnitude_key(threshold);
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  Slabs& s = slabs();
  if (static_cast<int64_t>(s.index.size()) < ranges * capacity) {
    s.index.resize(ranges * capacity);
    s.value.resize(ranges * capacity);
  }
  std::vector<int64_t> stored(ranges, 0);

  at::parallel_for(0, ranges, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      int32_t* slab_index = s.index.data() + t * capacity;
      float* slab_value = s.value.data() + t * capacity;
      int64_t count = 0;
      const int64_t end = n * (t + 1) / ranges;
      for (int64_t i = n * t / ranges; i < end; ++i) {
        const T a = compensate<T>(g[i], divisor, add_residual ? r + i : nullptr);
        const float af = to_float(a);
        if (magnitude_key(af) >= bar && count < capacity) {
          slab_index[count] = static_cast<int32_t>(i);
          slab_value[count] = af;
          ++count;
          if (r) r[i] = sent_remainder<T, V>(af, to_wire<V>(af));
        } else if (r) {
          r[i] = a;
        }
      }
      stored[t] = count;
    }
  });

  int64_t sent = 0;
  for (int64_t t = 0; t < ranges; ++t) {
    const int32_t* slab_index = s.index.data() + t * capacity;
    const float* slab_value = s.value.data() + t * capacity;
    for (int64_t j = 0; j < stored[t]; ++j) {
      if (sent < capacity) {
        out_index[sent] = slab_index[j] + static_cast<int32_t>(index_offset);
        out_value[sent] = to_wire<V>(slab_value[j]);
        ++sent;
      } else if (r) {
        r[slab_index[j]] = static_cast<T>(slab_value[j]);  // cut off: not sent, back into the residual
      }
    }
  }
  std::fill(out_index + sent, out_index + capacity, 0);
  std::fill(out_value + sent, out_value + capacity, static_cast<V>(0.0f));
  return sent;
}

at::Tensor ef_threshold_pack_cpu(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, double divisor,
                                 bool add_residual, double threshold, const at::Tensor& indices_out,
                                 const at::Tensor& values_out, int64_t index_offset) {
  check_pack_arguments("ef_threshold_pack", grad, residual, add_residual, indices_out, values_out);
  TORCH_CHECK(divisor > 0, "ef_threshold_pack: divisor must be > 0, got ", divisor);
  TORCH_CHECK(index_offset >= 0 && index_offset + grad.numel() <= std::numeric_limits<int32_t>::max(),
              "ef_threshold_pack: index_offset + n must fit in int32, got ", index_offset);
  int64_t sent = 0;
  SPARSECOMM_DISPATCH_FLOATING(grad.scalar_type(), "ef_threshold_pack", T, [&] {
    SPARSECOMM_DISPATCH_FLOATING(values_out.scalar_type(), "ef_threshold_pack", V, [&] {
      sent = ef_threshold_pack_impl<T, V>(grad, residual, static_cast<float>(divisor), add_residual,
                                          static_cast<float>(threshold), indices_out, values_out, index_offset);
    });
  });
  return at::scalar_tensor(sent, grad.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsecomm, CPU, m) {
  m.impl("ef_threshold_pack", &ef_threshold_pack_cpu);
}

}  // namespace sparsecomm
