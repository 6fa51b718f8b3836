// The one operator schema of sparsecomm. CPU implementations register in
// csrc/cpu/dispatch/cpu_ops.cpp, CUDA ones in csrc/cuda/*.cu. The semantics every backend
// implements (and the pure-torch twins in sparsecomm/ops/reference.py) are written down in
// csrc/README.md.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import sparsecomm._C` loads this library, which runs the registrations below; the
// module itself is empty (the ops live under torch.ops.sparsecomm).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(sparsecomm, m) {
  // Fused error feedback + exact top-k selection + packing (one payload per bucket).
  m.def("ef_topk_pack(Tensor grad, Tensor(a!)? residual, float divisor, bool add_residual, int k, "
        "Tensor(b!) indices_out, Tensor(c!) values_out, int index_offset) -> ()");
  // The same with a given threshold: one pass; returns how many entries were sent.
  m.def("ef_threshold_pack(Tensor grad, Tensor(a!)? residual, float divisor, bool add_residual, "
        "float threshold, Tensor(b!) indices_out, Tensor(c!) values_out, int index_offset) -> Tensor");
  // Scatter-add of world_size payloads into the dense bucket.
  m.def("unpack_add(Tensor indices, Tensor values, Tensor(a!) out, bool zero_out) -> ()");
  // selector="chunk", and exact top-k on the compact wire: fused error feedback + top-k +
  // index and value codecs into one payload; returns (bucket-relative indices int64,
  // decoded values). scale_group 0: per-chunk top-k, a scale per chunk; > 0: the bucket is
  // one chunk (chunk_size == numel), a scale per scale_group payload entries. Codec ids:
  // positions in chunk_codecs() (index 0 int32, 1 chunk, 2 rice; value 0 fp32, 1 bf16, 2
  // fp16, 3 fp8, 4 int8, 5 int4, 6 int2, 7 sign); csrc/README.md.
  m.def("chunk_encode(Tensor grad, Tensor(a!)? residual, float divisor, bool add_residual, int chunk_size, "
        "int k_full, int k_last, int index_codec, int value_codec, int scale_group, Tensor(b!) payload) "
        "-> (Tensor, Tensor)");
  // Decode world_size such payloads and add them, in rank order, into the dense bucket.
  m.def("chunk_decode_add(Tensor gathered, int chunk_size, int k_full, int k_last, int index_codec, "
        "int value_codec, int scale_group, Tensor(a!) out, bool zero_out) -> ()");
  // The codec names by id, (index codecs, value codecs): sparsecomm/ops/native.py checks
  // them against the Python tables when it loads the extension.
  m.def("chunk_codecs() -> (str[], str[])");
  // CRC-32C (Castagnoli) of a 1-D uint8 message (0-d int64 result) or of every row of a 2-D
  // one (int64 [rows]): the checksum sealing every sparse payload on the wire.
  m.def("crc32c(Tensor data) -> Tensor");
  // The instruction-set level of the CPU kernels in this process: "default", "avx2" or
  // "avx512" (csrc/README.md, "CPU levels"); raises if SPARSECOMM_CPU_CAPABILITY names a
  // level this CPU or build lacks.
  m.def("cpu_capability() -> str");
  // The CPU levels compiled in, and those of them this CPU supports (lowest first).
  m.def("cpu_levels() -> (str[], str[])");
}
