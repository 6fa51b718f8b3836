// Fused error feedback + exact top-k + packing on CPU: the shared selection of exact_topk.h
// (sampled one-pass strategy for large buckets at low density, two passes otherwise), whose
// payload order (two ascending runs, or one) the contract leaves unspecified.
#include "exact_topk.h"

namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE {

// Arguments checked by the caller (dispatch/cpu_ops.cpp).
void ef_topk_pack(const at::Tensor& grad, const c10::optional<at::Tensor>& residual, float divisor, bool add_residual,
                  int64_t k, const at::Tensor& indices_out, const at::Tensor& values_out, int64_t index_offset) {
  SPARSECOMM_DISPATCH_FLOATING(grad.scalar_type(), "ef_topk_pack", T, [&] {
    SPARSECOMM_DISPATCH_FLOATING(values_out.scalar_type(), "ef_topk_pack", V, [&] {
      exact_topk<T, V>(grad.const_data_ptr<T>(),
                       residual.has_value() ? residual->mutable_data_ptr<T>() : nullptr, divisor, add_residual,
                       grad.numel(), k, indices_out.mutable_data_ptr<int32_t>(), values_out.mutable_data_ptr<V>(),
                       static_cast<int32_t>(index_offset));
    });
  });
}

}  // namespace sparsecomm::SPARSECOMM_CPU_NAMESPACE
