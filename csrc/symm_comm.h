// NCCL communicator + symmetric-memory pool + symmetric collectives (SymmComm), and the constants of the pool.
//
// Design
// ------
// * One SymmComm owns (or borrows) one NCCL communicator on one CUDA device.
// * Pool: a few big regions from ncclMemAlloc, each registered ONCE with
//   ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC). Registration is collective: every rank must
//   create the same regions (same sizes) in the same order. Sub-allocations come from the deterministic
//   offset allocator (symm_offset_allocator.h), so the same sequence of alloc/free calls on every rank
//   yields the same offsets, which is what NCCL's symmetric kernels need.
// * Collectives run on the caller's current torch CUDA stream (c10's virtual CUDA guard; no c10/cuda
//   headers and no CUDA runtime calls, so this compiles against a CPU-only torch too).
// * NCCL >= 2.28.7 is required at runtime (checked with ncclGetVersion). NCCL only picks its symmetric
//   kernels (ncclSymkDevKernel_*) when both buffers lie in COLL_SYMMETRIC windows, the ranks are all on
//   direct NVLink (single node) and the collective is alone in its group; we check the first, the
//   Python layer checks the second, and we never group.
// * Averaging: up to NCCL 2.30.2 the symmetric reduce-scatter implements ncclSum only (ncclAvg and
//   ncclRedOpCreatePreMulSum both fall back to the classic ring/tree kernels). So reduce_scatter() always
//   reduces with ncclSum and, when scale_by_inverse_world is set, multiplies the OUTPUT by 1/world on the
//   same stream afterwards (output is 1/world of the input, so the extra pass is cheap). For fp16 inputs
//   whose sum may overflow, pre-scale the input instead (caller side).
//
// Lifetime
// --------
// close() (idempotent, collective): synchronizes the device, deregisters every window in creation order,
// releases the pool and destroys the communicator if we created it. Tensor views handed out by tensor()
// keep their region's memory alive (ncclMemFree runs when the pool AND the last view are gone), so a
// stale view never dangles; it simply is not symmetric any more. The destructor makes no NCCL call
// (ncclCommDestroy and ncclCommAbort are intra-node collectives too): without close(), the windows, their
// memory and an owned communicator are kept until the process exits.
//
// The class exists only when built with NCCL headers >= 2.27 (MFSDP_SYMM_COMM_ENABLED); the constants always.
#pragma once

#include <cstdint>

#if defined(MFSDP_WITH_NCCL)
#include <nccl.h>
#if defined(NCCL_VERSION_CODE) && defined(NCCL_WIN_COLL_SYMMETRIC) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
#define MFSDP_SYMM_COMM_ENABLED 1
#endif
#endif

#if defined(MFSDP_SYMM_COMM_ENABLED)
#include <ATen/ATen.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "symm_offset_allocator.h"
#endif

namespace mfsdp {
namespace symm {

constexpr int kMinNcclVersion = 22807;              // NCCL 2.28.7: the first with symmetric kernels we trust
constexpr int64_t kRegionGranularity = 2LL << 20;   // regions are whole 2 MiB pages on every rank
constexpr int64_t kDefaultGrowBytes = 256LL << 20;  // size of an automatically added region

#if defined(MFSDP_SYMM_COMM_ENABLED)

struct NcclRegion;  // one ncclMemAlloc'ed region (symm_comm.cpp)

// What stats() reports: the allocator's counters and one entry per region.
struct PoolStats {
  struct Region {
    int64_t offset;  // pool offset of the region's first byte
    int64_t bytes;
    int64_t ptr;  // device address
    bool registered;
  };
  int64_t capacity;
  int64_t bytes_in_use;
  int64_t largest_free;
  int64_t num_allocations;
  std::vector<Region> regions;
};

class SymmComm {
 public:
  // Borrow an existing communicator (e.g. ProcessGroupNCCL's, from _comm_ptr()). Never destroyed here.
  explicit SymmComm(int64_t comm_ptr);
  // Create a communicator from a unique id (bytes of ncclUniqueId) exchanged by the caller. Collective.
  SymmComm(const std::string& unique_id, int rank, int world_size, int device);
  ~SymmComm();
  SymmComm(const SymmComm&) = delete;
  SymmComm& operator=(const SymmComm&) = delete;

  // A fresh ncclUniqueId as bytes (call on one rank, share with the others).
  static std::string unique_id();

  // ---- pool ----
  // Adds one region of at least `nbytes` (rounded up to 2 MiB) and registers it as a symmetric window.
  // Collective: every rank must call it with the same size in the same order. Returns the region's first
  // pool offset.
  int64_t reserve(int64_t nbytes);
  // Sub-allocates `nbytes` (rounded up to 4096) and returns its pool offset. Deterministic: the same sequence
  // of alloc/free calls on every rank gives the same offsets. When nothing fits and grow is true, a new
  // region of max(nbytes, grow_bytes) is reserved, which is a collective call (all ranks reach it together
  // because they run the same sequence).
  int64_t alloc(int64_t nbytes, bool grow);
  void free(int64_t offset);
  // A 1-D tensor view of `numel` elements of `dtype` at pool offset `offset` (which must lie inside a live
  // allocation). The view keeps the region's memory alive; it does not keep the allocation: free() makes
  // the range reusable, exactly like any sub-allocator.
  at::Tensor tensor(int64_t offset, int64_t numel, at::ScalarType dtype);
  // Pool offset of t's first byte if t lies entirely inside a registered window, else -1.
  int64_t offset_of(const at::Tensor& t);
  bool contains(const at::Tensor& t) { return offset_of(t) >= 0; }

  // ---- collectives ----
  // output = concat over ranks of input (ncclAllGather). In place when input is output's slice for this rank
  // (input.data_ptr == output.data_ptr + rank * input.nbytes). Both must be contiguous, on this communicator's
  // device, of the same dtype, inside this pool's windows; output.numel == world * input.numel.
  void all_gather(const at::Tensor& input, const at::Tensor& output);
  // output = sum over ranks of input[rank * n : (rank + 1) * n] (ncclReduceScatter, ncclSum), then, when
  // scale_by_inverse_world, output *= 1 / world on the same stream. bf16/fp16/fp32. In place when output is
  // input's slice for this rank. Both contiguous, same device/dtype, inside this pool's windows;
  // input.numel == world * output.numel.
  void reduce_scatter(const at::Tensor& input, const at::Tensor& output, bool scale_by_inverse_world);

  // ---- collectives on any memory of this device (not only the pool; NCCL's regular kernels) ----
  // The plain path without ProcessGroupNCCL's per-call host work (fully_shard(native_collectives=True)).
  // outputs[i] = concat over ranks of inputs[i] for every i, as one NCCL group (ncclGroupStart/End). Each
  // inputs[i] is outputs[i]'s slot for this rank (in place) or apart from it; bytes travel as ncclUint8 for
  // dtypes NCCL lacks (FP8).
  void grouped_all_gather(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);
  // output = sum over ranks of input[rank * n : (rank + 1) * n] (ncclSum); bf16/fp16/fp32.
  void flat_reduce_scatter(const at::Tensor& input, const at::Tensor& output);
  // flat_reduce_scatter(inputs[i], outputs[i]) for every i, as one NCCL group: a unit's groups in one call.
  void grouped_reduce_scatter(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);
  // output[r * n : (r + 1) * n] = rank r's input[rank * n : (rank + 1) * n] (n = numel / world), one NCCL group of
  // ncclSend / ncclRecv per rank: reduce_comm_dtype's exchange of gradient shards.
  void all_to_all(const at::Tensor& input, const at::Tensor& output);
  // tensor = elementwise max over ranks of tensor, in place (fp32): FP8 groups' amax vectors.
  void all_reduce_max(const at::Tensor& tensor);

  // ---- teardown ----
  // Collective and idempotent: waits for the device, deregisters every window (creation order), releases
  // the pool, destroys the communicator if this object created it.
  void close();
  // Local and idempotent: forget the communicator without any NCCL call (for when it is already gone, e.g.
  // the process group was destroyed first). Windows and their memory are leaked on purpose.
  void abandon();

  // ---- properties ----
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int device() const { return device_; }
  bool owns_comm() const { return owns_; }
  bool closed() const { return closed_; }
  int64_t comm_ptr() const { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(comm_)); }
  // Set where leaving the communicator to the process's exit is the plan (native_collectives' communicator):
  // the destructor then does not warn that close() was never called.
  bool kept_until_exit() const { return kept_until_exit_; }
  void set_kept_until_exit(bool v) { kept_until_exit_ = v; }
  int64_t grow_bytes() const { return grow_bytes_; }
  void set_grow_bytes(int64_t b);
  int64_t capacity();
  int64_t bytes_in_use();
  PoolStats stats();

 private:
  struct Slot {
    std::shared_ptr<NcclRegion> mem;
    ncclWindow_t win = nullptr;
    int64_t begin = 0;  // pool offset of mem->base
    int64_t bytes = 0;
  };

  void query_comm();
  void check_open(const char* what) const;
  cudaStream_t current_stream() const;
  int64_t reserve_locked(int64_t nbytes);
  int64_t locate(const at::Tensor& t) const;
  void check_tensor(const at::Tensor& t, const char* op, const char* name) const;
  void check_in_window(const at::Tensor& t, const char* op, const char* name) const;
  void check_shard_and_full(const char* op, const at::Tensor& shard, const char* shard_name, const at::Tensor& full,
                            const char* full_name, bool in_pool = true) const;

  ncclComm_t comm_ = nullptr;
  bool owns_ = false;
  bool closed_ = false;
  bool kept_until_exit_ = false;
  int rank_ = -1;
  int world_ = 0;
  int device_ = -1;
  int64_t grow_bytes_ = kDefaultGrowBytes;
  OffsetAllocator alloc_;
  std::vector<Slot> slots_;
  std::mutex mu_;
};

#endif  // MFSDP_SYMM_COMM_ENABLED

}  // namespace symm
}  // namespace mfsdp
