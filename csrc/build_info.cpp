// build_info(), symm_comm_build_info(), nccl_version() (see build_info.h): read from the build's macros
// (setup.py defines MFSDP_WITH_CUDA, MFSDP_CUDA_ARCHS, MFSDP_WITH_NCCL) and from the loaded NCCL library.
#include "build_info.h"

#include <ATen/Config.h>  // AT_PARALLEL_OPENMP
#include <c10/util/Exception.h>

#include <string>

#include "fp8_gemm.h"
#include "optim.h"  // cpu_simd_paths
#include "symm_comm.h"  // MFSDP_SYMM_COMM_ENABLED, nccl.h, kMinNcclVersion
#include "symm_offset_allocator.h"

namespace py = pybind11;

#define MFSDP_STR_(x) #x
#define MFSDP_STR(x) MFSDP_STR_(x)
#ifndef MFSDP_CUDA_ARCHS
#define MFSDP_CUDA_ARCHS unknown
#endif

namespace mfsdp {

py::dict build_info() {
  py::dict d;
  d["native"] = true;
  d["cpu"] = true;
  // how at::parallel_for in the CPU kernels splits work: ATen's OpenMP backend needs _C itself compiled with
  // -fopenmp (build_config.py), else every CPU kernel runs on one thread
#if defined(_OPENMP)
  d["cpu_parallel"] = "openmp";
#elif AT_PARALLEL_OPENMP
  d["cpu_parallel"] = "none (built without -fopenmp)";
#else
  d["cpu_parallel"] = "aten";  // ATen's native thread pool, called through libtorch
#endif
  py::list simd;  // the CPU optimizer's code paths this CPU runs, best first
  for (const auto& path : cpu_simd_paths()) simd.append(path);
  d["cpu_simd_paths"] = simd;
#ifdef MFSDP_WITH_CUDA
  d["cuda"] = true;
  // the architectures the kernels were compiled for, e.g. "sm_90a" (several joined by "__")
  d["cuda_arch"] = MFSDP_STR(MFSDP_CUDA_ARCHS);
  d["fp8_gemm"] = std::string(fp8_gemm_cuda_backend());  // what fp8_gemm runs on CUDA tensors
#else
  d["cuda"] = false;
  d["cuda_arch"] = py::none();
  d["fp8_gemm"] = py::none();
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

py::dict symm_comm_build_info() {
  py::dict d;
#if defined(MFSDP_SYMM_COMM_ENABLED)
  d["built"] = true;
  d["reason"] = std::string("ok");
#elif defined(MFSDP_WITH_NCCL)
  d["built"] = false;
  d["reason"] = std::string(
      "mfsdp_ext._C was compiled against NCCL headers older than 2.27 (no ncclCommWindowRegister / "
      "NCCL_WIN_COLL_SYMMETRIC); rebuild against NCCL >= 2.28.7");
#else
  d["built"] = false;
  d["reason"] = std::string(
      "mfsdp_ext._C was built without NCCL (no CUDA toolkit or no nccl.h at build time); rebuild on a "
      "CUDA machine with the nvidia-nccl headers to get symmetric-memory collectives");
#endif
#if defined(MFSDP_WITH_NCCL) && defined(NCCL_VERSION_CODE)
  d["header_version"] = (int)NCCL_VERSION_CODE;
#else
  d["header_version"] = 0;
#endif
  d["min_runtime_version"] = symm::kMinNcclVersion;
  d["alignment"] = symm::kWindowAlignment;
  return d;
}

int nccl_version() {
#if defined(MFSDP_WITH_NCCL)
  int v = 0;
  ncclResult_t r = ncclGetVersion(&v);
  TORCH_CHECK(r == ncclSuccess, "mfsdp_ext: ncclGetVersion failed: ", ncclGetErrorString(r));
  return v;
#else
  return 0;
#endif
}

}  // namespace mfsdp
