// NCCL communicator + symmetric-memory pool + symmetric collectives for mfsdp_ext._C.
//
// This header only declares the registration hook, so that bindings.cpp can include it without
// the NCCL include path. Everything NCCL-specific lives in symm_comm.cpp behind MFSDP_WITH_NCCL.
//
// Python surface (module mfsdp_ext._C), registered by mfsdp_register_symm_comm():
//   nccl_version() -> int                 runtime NCCL version code (e.g. 22809), 0 if built without NCCL
//   symm_comm_build_info() -> dict        {"built": bool, "reason": str, "header_version": int,
//                                          "min_runtime_version": int, "alignment": int}
//   SymmOffsetAllocator                   the deterministic offset allocator used by the pool
//                                         (pure bookkeeping, present in every build; unit-testable on CPU)
//   SymmComm                              only when built with NCCL >= 2.27 headers (see symm_comm.cpp)
#pragma once

#include <pybind11/pybind11.h>

// Registers the symmetric-memory bindings on the extension module. Always defined: on builds
// without NCCL it registers the build-info functions and the offset allocator only.
void mfsdp_register_symm_comm(pybind11::module_& m);
