// Python bindings of mfsdp_ext._C: registration only (which file holds what: csrc/README.md).
// Kernels: cast.cpp / pack.cpp / quantize.cpp / optim.cpp (entry points) over *_cpu.cpp / *_cuda.cu; build description:
// build_info.cpp; symmetric memory: symm_offset_allocator.cpp and symm_comm.cpp (SymmComm only when built with
// NCCL). Constants the Python layer needs are defined once in C++ and exported here as module attributes.
#include <torch/extension.h>

#include "build_info.h"
#include "capture_info.h"
#include "cast.h"
#include "float_formats.h"  // E4M3T / E5M2T::max_value
#include "fp8_gemm.h"
#include "fp8_linear.h"
#include "host_agree.h"
#include "launch.h"         // kInlineTableEntries, QuantizeAlgo, kOptimInlineRuns, kOptimCoeffs
#include "optim.h"
#include "pack.h"
#include "quantize.h"
#include "symm_comm.h"
#include "symm_offset_allocator.h"

namespace py = pybind11;

namespace {

void register_kernels(py::module_& m) {
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
        py::arg("amax") = py::none(), py::arg("dst_t") = py::none(), py::arg("eps") = 1e-12,
        py::arg("algo") = static_cast<int64_t>(mfsdp::kQuantizeAuto));
  m.def("fp8_transpose", &mfsdp::fp8_transpose, release(), py::arg("src"), py::arg("dst"));
  m.def("fp8_gemm", &mfsdp::fp8_gemm, release(), py::arg("a"), py::arg("b"), py::arg("scale_a"), py::arg("scale_b"),
        py::arg("bias"), py::arg("out_dtype"), py::arg("fast_accum"));
  m.def("fp8_gemm_calls", &mfsdp::fp8_gemm_calls);
  m.def("fp8_linear", &mfsdp::fp8_linear, release(), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("w8"),
        py::arg("w_scale_inv"), py::arg("w8t"), py::arg("grad_dtype"), py::arg("need_dx"), py::arg("need_dw"),
        py::arg("fp8_wgrad"), py::arg("fast_accum"), py::arg("eps"), py::arg("algo"), py::arg("x8") = py::none(),
        py::arg("x_scale_inv") = py::none(), py::arg("x8t") = py::none());
  m.def("fp8_quantize_input", &mfsdp::fp8_quantize_input, release(), py::arg("x"), py::arg("keep_x_t"),
        py::arg("eps"), py::arg("algo"));
  m.def("fp8_linear_forward", &mfsdp::fp8_linear_forward, release(), py::arg("x"), py::arg("w8"),
        py::arg("w_scale_inv"), py::arg("bias"), py::arg("keep_x_t"), py::arg("fast_accum"), py::arg("eps"),
        py::arg("algo"));
  m.def("fp8_linear_backward", &mfsdp::fp8_linear_backward, release(), py::arg("dy"), py::arg("grad_dtype"),
        py::arg("w8t"), py::arg("w_scale_inv"), py::arg("x8t"), py::arg("x_scale_inv"), py::arg("dx_dtype"),
        py::arg("dw_dtype"), py::arg("eps"), py::arg("algo"));
  m.def("adamw_step", &mfsdp::adamw_step, release(), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("runs"), py::arg("coeffs"), py::arg("device_table") = py::none());
  m.def("sgd_step", &mfsdp::sgd_step, release(), py::arg("param"), py::arg("grad"), py::arg("momentum_buffer"),
        py::arg("runs"), py::arg("coeffs"), py::arg("device_table") = py::none());
  m.def("cpu_simd", &mfsdp::cpu_simd, "The code path of the CPU optimizer kernels: avx512, avx or scalar.");
  m.def("set_cpu_simd", &mfsdp::set_cpu_simd, py::arg("path"),
        "Force the CPU optimizer kernels' code path (auto, scalar, avx, avx512); returns the one before.");
  m.def("cpu_simd_paths", &mfsdp::cpu_simd_paths, "The CPU optimizer code paths this CPU supports, best first.");
  m.def("check_segments", &mfsdp::check_segments, release(), py::arg("segments"), py::arg("total"));
  m.def("host_max_agree", &mfsdp::host_max_agree, release(), py::arg("slots"), py::arg("rank"), py::arg("world"),
        py::arg("seq"), py::arg("values"), py::arg("timeout_s"));
}

void register_constants(py::module_& m) {
  m.attr("FP8_E4M3_MAX") = static_cast<double>(mfsdp::E4M3T::max_value);
  m.attr("FP8_E5M2_MAX") = static_cast<double>(mfsdp::E5M2T::max_value);
  m.attr("PACK_INLINE_TABLE_ENTRIES") = mfsdp::kInlineTableEntries;
  m.attr("OPTIM_INLINE_RUNS") = mfsdp::kOptimInlineRuns;
  m.attr("OPTIM_COEFFS") = mfsdp::kOptimCoeffs;
  m.attr("AGREE_RANK_WORDS") = mfsdp::kAgreeRankWords;
  m.attr("AGREE_MAX_VALUES") = mfsdp::kAgreeMaxValues;
  py::dict algos;  // fp8_quantize's algo argument
  algos["auto"] = static_cast<int>(mfsdp::kQuantizeAuto);
  algos["two_pass"] = static_cast<int>(mfsdp::kQuantizeTwoPass);
  algos["fused"] = static_cast<int>(mfsdp::kQuantizeFused);
  m.attr("QUANTIZE_ALGOS") = algos;
  m.attr("SYMM_ALIGNMENT") = mfsdp::symm::kWindowAlignment;
  m.attr("SYMM_REGION_GRANULARITY") = mfsdp::symm::kRegionGranularity;
  m.attr("SYMM_DEFAULT_GROW_BYTES") = mfsdp::symm::kDefaultGrowBytes;
  m.attr("MIN_NCCL_VERSION") = mfsdp::symm::kMinNcclVersion;
}

void register_offset_allocator(py::module_& m) {
  using mfsdp::symm::OffsetAllocator;
  py::class_<OffsetAllocator>(m, "SymmOffsetAllocator",
                              "Deterministic first-fit offset allocator behind SymmComm's pool (bookkeeping only).")
      .def(py::init<int64_t>(), py::arg("alignment") = mfsdp::symm::kWindowAlignment)
      .def("add_region", &OffsetAllocator::add_region, py::arg("nbytes"),
           "Append a region (rounded up to the alignment); returns its first offset.")
      .def("alloc", &OffsetAllocator::alloc, py::arg("nbytes"), "Offset of a new block, or -1 if nothing fits.")
      .def("free", &OffsetAllocator::free, py::arg("offset"))
      .def("find_allocation", &OffsetAllocator::find_allocation, py::arg("offset"), py::arg("nbytes"))
      .def("region_index", &OffsetAllocator::region_index, py::arg("offset"))
      .def("allocations", &OffsetAllocator::allocations)
      .def_property_readonly("alignment", &OffsetAllocator::alignment)
      .def_property_readonly("capacity", &OffsetAllocator::capacity)
      .def_property_readonly("used", &OffsetAllocator::used)
      .def_property_readonly("largest_free", &OffsetAllocator::largest_free)
      .def_property_readonly("num_regions", &OffsetAllocator::num_regions)
      .def_property_readonly("num_allocations", &OffsetAllocator::num_allocations);
}

#if defined(MFSDP_SYMM_COMM_ENABLED)
py::dict pool_stats_dict(const mfsdp::symm::PoolStats& st) {
  py::dict d;
  d["capacity"] = st.capacity;
  d["bytes_in_use"] = st.bytes_in_use;
  d["largest_free"] = st.largest_free;
  d["num_allocations"] = st.num_allocations;
  py::list regions;
  for (const auto& r : st.regions) {
    py::dict rd;
    rd["offset"] = r.offset;
    rd["bytes"] = r.bytes;
    rd["ptr"] = r.ptr;
    rd["registered"] = r.registered;
    regions.append(rd);
  }
  d["regions"] = regions;
  return d;
}

void register_symm_comm(py::module_& m) {
  using mfsdp::symm::SymmComm;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<SymmComm, std::shared_ptr<SymmComm>>(
      m, "SymmComm",
      "NCCL communicator (borrowed or owned) with a symmetric-memory pool and symmetric all-gather / "
      "reduce-scatter on the current torch CUDA stream.")
      .def(py::init<int64_t>(), py::arg("comm_ptr"), release(),
           "Borrow an existing ncclComm_t (e.g. pg._get_backend(dev)._comm_ptr()). Never destroyed by us.")
      .def(py::init([](py::bytes unique_id, int rank, int world_size, int device) {
             std::string id = unique_id;  // copy while holding the GIL
             py::gil_scoped_release nogil;
             return std::make_shared<SymmComm>(id, rank, world_size, device);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device"),
           "Create (collectively) a communicator from SymmComm.unique_id() bytes shared by the caller.")
      .def_static("unique_id", []() { return py::bytes(SymmComm::unique_id()); },
                  "A fresh ncclUniqueId as bytes (call on one rank).")
      .def("reserve", &SymmComm::reserve, py::arg("nbytes"), release(),
           "Collective: add and register a region of >= nbytes (2 MiB granularity). Returns its pool offset.")
      .def("alloc", &SymmComm::alloc, py::arg("nbytes"), py::arg("grow") = true, release(),
           "Pool offset of a new 4096-aligned block (deterministic across ranks). May reserve (collective).")
      .def("free", &SymmComm::free, py::arg("offset"))
      .def("tensor", &SymmComm::tensor, py::arg("offset"), py::arg("numel"), py::arg("dtype"),
           "1-D CUDA tensor view of numel elements at a pool offset inside a live allocation.")
      .def("offset_of", &SymmComm::offset_of, py::arg("tensor"), "Pool offset of tensor, or -1 if not in a window.")
      .def("contains", &SymmComm::contains, py::arg("tensor"))
      .def("all_gather", &SymmComm::all_gather, py::arg("input"), py::arg("output"), release(),
           "ncclAllGather on the current stream; in place when input is output's slot for this rank.")
      .def("reduce_scatter", &SymmComm::reduce_scatter, py::arg("input"), py::arg("output"),
           py::arg("scale_by_inverse_world") = false, release(),
           "ncclReduceScatter(ncclSum) on the current stream; optionally output *= 1/world afterwards.")
      .def("grouped_all_gather", &SymmComm::grouped_all_gather, py::arg("inputs"), py::arg("outputs"), release(),
           "One NCCL group of ncclAllGather(inputs[i] -> outputs[i]) on the current stream; any device memory.")
      .def("flat_reduce_scatter", &SymmComm::flat_reduce_scatter, py::arg("input"), py::arg("output"), release(),
           "ncclReduceScatter(ncclSum) on the current stream; any device memory.")
      .def("grouped_reduce_scatter", &SymmComm::grouped_reduce_scatter, py::arg("inputs"), py::arg("outputs"),
           release(), "One NCCL group of ncclReduceScatter(ncclSum, inputs[i] -> outputs[i]) on the current stream.")
      .def("all_to_all", &SymmComm::all_to_all, py::arg("input"), py::arg("output"), release(),
           "Equal-split all-to-all as one NCCL group of ncclSend / ncclRecv on the current stream.")
      .def("all_reduce_max", &SymmComm::all_reduce_max, py::arg("tensor"), release(),
           "In-place ncclAllReduce(ncclMax) of a float32 tensor on the current stream.")
      .def("close", &SymmComm::close, release(), "Collective, idempotent teardown.")
      .def("abandon", &SymmComm::abandon,
           "Mark closed without NCCL calls (the communicator is already gone); leaks the windows' memory.")
      .def("stats", [](SymmComm& c) { return pool_stats_dict(c.stats()); })
      .def_property_readonly("rank", &SymmComm::rank)
      .def_property_readonly("world_size", &SymmComm::world_size)
      .def_property_readonly("device", &SymmComm::device)
      .def_property_readonly("owns_comm", &SymmComm::owns_comm)
      .def_property_readonly("closed", &SymmComm::closed)
      .def_property_readonly("comm_ptr", &SymmComm::comm_ptr)
      .def_property_readonly("capacity", &SymmComm::capacity)
      .def_property_readonly("bytes_in_use", &SymmComm::bytes_in_use)
      .def_property("grow_bytes", &SymmComm::grow_bytes, &SymmComm::set_grow_bytes)
      .def_property("kept_until_exit", &SymmComm::kept_until_exit, &SymmComm::set_kept_until_exit,
                    "True: the destructor does not warn about a missing close() (kept until the process exits).")
      .def_property_readonly_static("alignment", [](py::object) { return mfsdp::symm::kWindowAlignment; });
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mfsdp_ext native kernels (see mfsdp_ext/_native/__init__.py for the contract)";
  register_kernels(m);
  m.def("build_info", &mfsdp::build_info);
  register_constants(m);
  m.def("nccl_version", &mfsdp::nccl_version,
        "Version code of the NCCL library loaded at run time (e.g. 22809 for 2.28.9); 0 when built without NCCL.");
  m.def("symm_comm_build_info", &mfsdp::symm_comm_build_info,
        "Whether the symmetric-memory communicator (SymmComm) was compiled in, and why not.");
  m.def("current_capture_id", &mfsdp::current_capture_id, py::arg("device"),
        "The id of the CUDA graph capture under way on the device's current stream; 0 when none.");
  register_offset_allocator(m);
#if defined(MFSDP_SYMM_COMM_ENABLED)
  register_symm_comm(m);
#endif
}
