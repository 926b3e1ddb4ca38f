// Python bindings of mfsdp_ext._C: registration only. Kernels: pack.cpp / cast.cpp / quantize.cpp (+ .cu); NCCL
// communicator and symmetric-memory collectives: symm_comm.cpp (its NCCL part built when NCCL is found).
#include <torch/extension.h>

#include "cast.h"
#include "pack.h"
#include "quantize.h"

#include "symm_comm.h"
#ifdef MFSDP_WITH_NCCL
#include <nccl.h>
#endif

namespace py = pybind11;

#define MFSDP_STR_(x) #x
#define MFSDP_STR(x) MFSDP_STR_(x)
#ifndef MFSDP_CUDA_ARCHS
#define MFSDP_CUDA_ARCHS unknown
#endif

namespace {

py::dict build_info() {
  py::dict d;
  d["native"] = true;
  d["cpu"] = true;
#ifdef MFSDP_WITH_CUDA
  d["cuda"] = true;
  // the architectures the kernels were compiled for, e.g. "sm_90a" (several joined by "__")
  d["cuda_arch"] = MFSDP_STR(MFSDP_CUDA_ARCHS);
#else
  d["cuda"] = false;
  d["cuda_arch"] = py::none();
#endif
#ifdef MFSDP_WITH_NCCL
  d["nccl"] = true;
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess) {
    d["nccl_version"] = py::make_tuple(v / 10000, (v % 10000) / 100, v % 100);
  } else {
    d["nccl_version"] = py::none();
  }
  d["nccl_header_version"] = py::make_tuple(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
#else
  d["nccl"] = false;
  d["nccl_version"] = py::none();
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mfsdp_ext native kernels (see mfsdp_ext/_native.py for the contract)";
  using release = py::call_guard<py::gil_scoped_release>;

  m.def("pack", &mfsdp::pack, release(), py::arg("tensors"), py::arg("offsets"), py::arg("out"),
        py::arg("scale") = 1.0);
  m.def("pack_pieces", &mfsdp::pack_pieces, release(), py::arg("tensors"), py::arg("pieces"), py::arg("out"),
        py::arg("scale") = 1.0);
  m.def("unpack", &mfsdp::unpack, release(), py::arg("flat"), py::arg("offsets"), py::arg("outs"));
  m.def("cast", &mfsdp::cast, release(), py::arg("src"), py::arg("dst"));
  m.def("segment_amax", &mfsdp::segment_amax, release(), py::arg("src"), py::arg("segments"), py::arg("amax"));
  m.def("fp8_cast", &mfsdp::fp8_cast, release(), py::arg("src"), py::arg("segments"), py::arg("amax"),
        py::arg("dst"), py::arg("scale_inv"), py::arg("eps") = 1e-12);
  m.def("fp8_dequantize", &mfsdp::fp8_dequantize, release(), py::arg("src"), py::arg("segments"),
        py::arg("scale_inv"), py::arg("dst"));
  m.def("grad_accumulate", &mfsdp::grad_accumulate, release(), py::arg("main_grad"), py::arg("reduced"),
        py::arg("scale"), py::arg("accumulate"));
  m.def("fp8_quantize", &mfsdp::fp8_quantize, release(), py::arg("src"), py::arg("dst"), py::arg("scale_inv"),
        py::arg("amax") = py::none(), py::arg("dst_t") = py::none(), py::arg("eps") = 1e-12, py::arg("algo") = 0);
  m.def("fp8_transpose", &mfsdp::fp8_transpose, release(), py::arg("src"), py::arg("dst"));
  m.def("check_segments", &mfsdp::check_segments, release(), py::arg("segments"), py::arg("total"));
  m.def("build_info", &build_info);
  mfsdp_register_symm_comm(m);
}
