// What this build of mfsdp_ext._C contains (CUDA kernels, NCCL, SymmComm), for build_info() and
// symm_comm_build_info(), and the version of the NCCL library loaded at run time.
#pragma once

#include <pybind11/pybind11.h>

namespace mfsdp {

pybind11::dict build_info();
pybind11::dict symm_comm_build_info();
// Version code of the NCCL library loaded at run time (e.g. 22809 for 2.28.9); 0 when built without NCCL.
int nccl_version();

}  // namespace mfsdp
