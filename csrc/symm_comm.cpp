// NCCL communicator + symmetric-memory pool + symmetric collectives (see symm_comm.h).
//
// Design
// ------
// * One SymmComm owns (or borrows) one NCCL communicator on one CUDA device.
// * Pool: a few big regions from ncclMemAlloc, each registered ONCE with
//   ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC). Registration is collective: every rank must
//   create the same regions (same sizes) in the same order. Sub-allocations come from a deterministic
//   first-fit offset allocator (4096-byte granularity), so the same sequence of alloc/free calls on every
//   rank yields the same offsets, which is what NCCL's symmetric kernels need.
// * Collectives run on the caller's current torch CUDA stream (c10's virtual CUDA guard; no c10/cuda
//   headers and no CUDA runtime calls, so this file compiles against a CPU-only torch too).
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

#include "symm_comm.h"

#include "common.h"  // bytes_overlap

#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(MFSDP_WITH_NCCL)
#include <nccl.h>
#if defined(NCCL_VERSION_CODE) && defined(NCCL_WIN_COLL_SYMMETRIC) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
#define MFSDP_SYMM_COMM_ENABLED 1
#endif
#endif

namespace py = pybind11;

namespace mfsdp {
namespace symm {

constexpr int64_t kAlignment = 4096;                  // window offsets of every sub-allocation
constexpr int64_t kRegionGranularity = 2LL << 20;     // regions are whole 2 MiB pages on every rank
constexpr int64_t kDefaultGrowBytes = 256LL << 20;    // size of an automatically added region
constexpr int kMinRuntimeVersion = 22807;             // NCCL 2.28.7

static int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static std::string version_string(int code) {
  if (code <= 0) return "none";
  int major, minor, patch;
  if (code >= 10000) {
    major = code / 10000; minor = (code % 10000) / 100; patch = code % 100;
  } else {  // old encoding, X*1000 + Y*100 + Z
    major = code / 1000; minor = (code % 1000) / 100; patch = code % 100;
  }
  std::ostringstream s;
  s << major << "." << minor << "." << patch;
  return s.str();
}

// ----------------------------------------------------------------------------------------------
// Deterministic offset allocator (pure bookkeeping; no CUDA, no NCCL).
// Offsets live in one "pool space": region k covers [begin_k, begin_k + bytes_k), regions are laid out
// back to back in creation order. Allocation is first fit by lowest offset, sizes are rounded up to the
// alignment, frees coalesce with free neighbours in the same region. Blocks never span regions.
// ----------------------------------------------------------------------------------------------
class OffsetAllocator {
 public:
  explicit OffsetAllocator(int64_t alignment = kAlignment) : alignment_(alignment) {
    TORCH_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0,
                "SymmOffsetAllocator: alignment must be a power of two, got ", alignment);
  }

  int64_t add_region(int64_t bytes) {
    TORCH_CHECK(bytes > 0, "SymmOffsetAllocator.add_region: bytes must be > 0, got ", bytes);
    Region r;
    r.begin = capacity_;
    r.bytes = round_up(bytes, alignment_);
    r.free.emplace(r.begin, r.bytes);
    capacity_ += r.bytes;
    regions_.push_back(std::move(r));
    return regions_.back().begin;
  }

  // Returns the offset, or -1 when no region has a free block that fits.
  int64_t alloc(int64_t bytes) {
    TORCH_CHECK(bytes >= 0, "SymmOffsetAllocator.alloc: bytes must be >= 0, got ", bytes);
    const int64_t size = round_up(std::max<int64_t>(bytes, 1), alignment_);
    for (auto& r : regions_) {
      for (auto it = r.free.begin(); it != r.free.end(); ++it) {
        if (it->second < size) continue;
        const int64_t off = it->first;
        const int64_t rest = it->second - size;
        r.free.erase(it);
        if (rest > 0) r.free.emplace(off + size, rest);
        allocated_.emplace(off, size);
        used_ += size;
        return off;
      }
    }
    return -1;
  }

  void free(int64_t offset) {
    auto it = allocated_.find(offset);
    TORCH_CHECK(it != allocated_.end(), "SymmOffsetAllocator.free: offset ", offset,
                " is not the start of a live allocation");
    const int64_t size = it->second;
    allocated_.erase(it);
    used_ -= size;
    Region& r = regions_[region_index(offset)];
    int64_t off = offset, len = size;
    auto next = r.free.lower_bound(off);
    if (next != r.free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        off = prev->first;
        len += prev->second;
        r.free.erase(prev);
      }
    }
    next = r.free.lower_bound(off);
    if (next != r.free.end() && off + len == next->first) {
      len += next->second;
      r.free.erase(next);
    }
    r.free.emplace(off, len);
  }

  // Start of the live allocation that contains [offset, offset + bytes), or -1.
  int64_t find_allocation(int64_t offset, int64_t bytes) const {
    auto it = allocated_.upper_bound(offset);
    if (it == allocated_.begin()) return -1;
    --it;
    const int64_t end = it->first + it->second;
    if (offset < end && offset + std::max<int64_t>(bytes, 0) <= end) return it->first;
    return -1;
  }

  int region_index(int64_t offset) const {
    for (size_t i = 0; i < regions_.size(); ++i) {
      if (offset >= regions_[i].begin && offset < regions_[i].begin + regions_[i].bytes) return (int)i;
    }
    TORCH_CHECK(false, "SymmOffsetAllocator: offset ", offset, " is outside every region");
    return -1;
  }

  int64_t largest_free() const {
    int64_t best = 0;
    for (const auto& r : regions_)
      for (const auto& kv : r.free) best = std::max(best, kv.second);
    return best;
  }

  std::vector<std::pair<int64_t, int64_t>> allocations() const {
    return {allocated_.begin(), allocated_.end()};
  }

  int64_t alignment() const { return alignment_; }
  int64_t capacity() const { return capacity_; }
  int64_t used() const { return used_; }
  int num_regions() const { return (int)regions_.size(); }
  int64_t num_allocations() const { return (int64_t)allocated_.size(); }

 private:
  struct Region {
    int64_t begin = 0;
    int64_t bytes = 0;
    std::map<int64_t, int64_t> free;  // offset -> size
  };
  int64_t alignment_;
  int64_t capacity_ = 0;
  int64_t used_ = 0;
  std::vector<Region> regions_;
  std::map<int64_t, int64_t> allocated_;  // offset -> size
};

#if defined(MFSDP_SYMM_COMM_ENABLED)

// ----------------------------------------------------------------------------------------------
// NCCL error handling
// ----------------------------------------------------------------------------------------------
[[noreturn]] static void throw_nccl(const char* call, ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  std::ostringstream s;
  s << "mfsdp_ext SymmComm: " << call << " failed: " << ncclGetErrorString(r) << " (ncclResult_t " << (int)r
    << ")";
  if (last != nullptr && last[0] != '\0') s << "; NCCL says: " << last;
  throw std::runtime_error(s.str());
}

// Non-blocking communicators (ncclConfig_t.blocking = 0, e.g. some ProcessGroupNCCL setups) return
// ncclInProgress; wait until the communicator settles.
static ncclResult_t wait_ready(ncclComm_t comm) {
  ncclResult_t state = ncclInProgress;
  while (true) {
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    std::this_thread::yield();
  }
}

#define MFSDP_NCCL_CHECK(call, comm)                                   \
  do {                                                                 \
    ncclResult_t mfsdp_r_ = (call);                                    \
    if (mfsdp_r_ == ncclInProgress && (comm) != nullptr) {             \
      mfsdp_r_ = wait_ready(comm);                                     \
    }                                                                  \
    if (mfsdp_r_ != ncclSuccess) throw_nccl(#call, mfsdp_r_, (comm));  \
  } while (0)

static int runtime_nccl_version() {
  int v = 0;
  ncclResult_t r = ncclGetVersion(&v);
  if (r != ncclSuccess) throw_nccl("ncclGetVersion(&version)", r, nullptr);
  return v;
}

static void require_runtime_version() {
  const int v = runtime_nccl_version();
  TORCH_CHECK(v >= kMinRuntimeVersion, "mfsdp_ext SymmComm: the loaded NCCL library is ", version_string(v),
              " but symmetric-memory collectives need NCCL >= ", version_string(kMinRuntimeVersion),
              " (libnccl.so.2 found at run time; check LD_LIBRARY_PATH / the nvidia-nccl wheel)");
}

static c10::Device cuda_device(int index) { return c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)index); }

// ----------------------------------------------------------------------------------------------
// One ncclMemAlloc'ed region. Freed when the pool and every tensor view of it are gone.
// ----------------------------------------------------------------------------------------------
struct NcclRegion {
  void* base = nullptr;
  int device = -1;
  bool leak = false;  // set when the window could not be deregistered: never free registered memory

  ~NcclRegion() {
    if (base == nullptr || leak) return;
    try {
      c10::DeviceGuard guard(cuda_device(device));
      // Tensor views may die while kernels that use them are still queued: make sure none is.
      c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).synchronizeDevice((c10::DeviceIndex)device);
      ncclResult_t r = ncclMemFree(base);
      if (r != ncclSuccess) {
        std::fprintf(stderr, "mfsdp_ext SymmComm: ncclMemFree(%p) failed: %s\n", base, ncclGetErrorString(r));
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "mfsdp_ext SymmComm: freeing a pool region failed: %s\n", e.what());
    }
    base = nullptr;
  }
};

static ncclDataType_t reduce_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kFloat: return ncclFloat32;
    default:
      TORCH_CHECK(false, "mfsdp_ext SymmComm.reduce_scatter: dtype ", t,
                  " is not supported (bfloat16, float16 and float32 are; NCCL's symmetric reduce kernels "
                  "implement floating-point sums only)");
  }
  return ncclFloat32;  // unreachable
}

// All-gather moves bytes: native types for the 16/32-bit floats, bytes (ncclUint8) for everything else
// (uint8, int8, bool, float8_e4m3fn / e5m2, ...). NCCL's symmetric all-gather exists for every type.
static void gather_type(at::ScalarType t, int64_t numel, ncclDataType_t* type, size_t* count) {
  switch (t) {
    case at::kBFloat16: *type = ncclBfloat16; *count = (size_t)numel; return;
    case at::kHalf: *type = ncclFloat16; *count = (size_t)numel; return;
    case at::kFloat: *type = ncclFloat32; *count = (size_t)numel; return;
    default:
      *type = ncclUint8;
      *count = (size_t)numel * c10::elementSize(t);
      return;
  }
}

// ----------------------------------------------------------------------------------------------
// SymmComm
// ----------------------------------------------------------------------------------------------
class SymmComm {
 public:
  // Borrow an existing communicator (e.g. ProcessGroupNCCL's, from _comm_ptr()). Never destroyed here.
  explicit SymmComm(int64_t comm_ptr) : alloc_(kAlignment) {
    TORCH_CHECK(comm_ptr != 0,
                "mfsdp_ext SymmComm: comm_ptr is 0 (the ProcessGroupNCCL communicator does not exist yet; "
                "init the group with init_process_group(\"nccl\", device_id=...) or run one collective first)");
    require_runtime_version();
    comm_ = reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comm_ptr));
    owns_ = false;
    query_comm();
  }

  // Create a communicator from a unique id (bytes of ncclUniqueId) exchanged by the caller. Collective.
  SymmComm(const std::string& unique_id, int rank, int world_size, int device) : alloc_(kAlignment) {
    TORCH_CHECK(unique_id.size() == sizeof(ncclUniqueId), "mfsdp_ext SymmComm: unique_id must be ",
                sizeof(ncclUniqueId), " bytes (from SymmComm.unique_id()), got ", unique_id.size());
    TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "mfsdp_ext SymmComm: bad rank ", rank,
                " for world_size ", world_size);
    TORCH_CHECK(device >= 0, "mfsdp_ext SymmComm: bad CUDA device index ", device);
    require_runtime_version();
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    {
      c10::DeviceGuard guard(cuda_device(device));
      ncclComm_t c = nullptr;
      ncclResult_t r = ncclCommInitRank(&c, world_size, id, rank);
      if (r == ncclInProgress && c != nullptr) r = wait_ready(c);
      if (r != ncclSuccess) throw_nccl("ncclCommInitRank(&comm, world_size, unique_id, rank)", r, c);
      comm_ = c;
    }
    owns_ = true;
    query_comm();
    TORCH_CHECK(rank_ == rank && world_ == world_size && device_ == device,
                "mfsdp_ext SymmComm: communicator reports rank/size/device ", rank_, "/", world_, "/", device_,
                ", expected ", rank, "/", world_size, "/", device);
  }

  ~SymmComm() {
    if (closed_) return;
    // No NCCL call here: ncclCommDestroy, ncclCommAbort and window deregistration are intra-node collectives,
    // and objects are garbage-collected at different moments on different ranks, so a rank destroying its
    // communicator here would wait for peers that are busy elsewhere (a hang). Without close(), the
    // communicator (if ours), the windows and their memory stay until the process exits.
    size_t windows = 0;
    for (auto& s : slots_) {
      if (s.win != nullptr) {
        s.mem->leak = true;  // registered memory is never freed behind NCCL's back
        ++windows;
      }
    }
    if (windows > 0 || owns_) {
      std::fprintf(stderr,
                   "mfsdp_ext SymmComm: destroyed without close(); %s%zu symmetric window(s) (%lld bytes) stay "
                   "until the process exits. Call close() (or release_symmetric_memory() on a fully_shard "
                   "root) on every rank to free them.\n",
                   owns_ ? "its own NCCL communicator and " : "", windows, (long long)alloc_.capacity());
    }
    comm_ = nullptr;
    slots_.clear();
  }

  SymmComm(const SymmComm&) = delete;
  SymmComm& operator=(const SymmComm&) = delete;

  static py::bytes unique_id() {
    ncclUniqueId id;
    MFSDP_NCCL_CHECK(ncclGetUniqueId(&id), (ncclComm_t) nullptr);
    return py::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
  }

  // ---- pool ----------------------------------------------------------------------------------

  // Adds one region of at least `nbytes` (rounded up to 2 MiB) and registers it as a symmetric window.
  // Collective: every rank must call it with the same size in the same order. Returns the region's first
  // pool offset.
  int64_t reserve(int64_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    check_open("reserve");
    return reserve_locked(nbytes);
  }

  // Sub-allocates `nbytes` (rounded up to 4096) and returns its pool offset. Deterministic: the same sequence
  // of alloc/free calls on every rank gives the same offsets. When nothing fits and grow is true, a new
  // region of max(nbytes, grow_bytes) is reserved, which is a collective call (all ranks reach it together
  // because they run the same sequence).
  int64_t alloc(int64_t nbytes, bool grow) {
    std::lock_guard<std::mutex> lock(mu_);
    check_open("alloc");
    TORCH_CHECK(nbytes >= 0, "mfsdp_ext SymmComm.alloc: nbytes must be >= 0, got ", nbytes);
    int64_t off = alloc_.alloc(nbytes);
    if (off >= 0) return off;
    TORCH_CHECK(grow, "mfsdp_ext SymmComm.alloc: symmetric pool exhausted (", nbytes, " bytes requested, ",
                alloc_.capacity() - alloc_.used(), " of ", alloc_.capacity(), " bytes free, largest free block ",
                alloc_.largest_free(), "); reserve() more or pass grow=True");
    reserve_locked(std::max<int64_t>(round_up(std::max<int64_t>(nbytes, 1), kAlignment), grow_bytes_));
    off = alloc_.alloc(nbytes);
    TORCH_CHECK(off >= 0, "mfsdp_ext SymmComm.alloc: internal error, a fresh region did not fit ", nbytes,
                " bytes");
    return off;
  }

  void free(int64_t offset) {
    std::lock_guard<std::mutex> lock(mu_);
    alloc_.free(offset);
  }

  // A 1-D tensor view of `numel` elements of `dtype` at pool offset `offset` (which must lie inside a live
  // allocation). The view keeps the region's memory alive; it does not keep the allocation: free() makes
  // the range reusable, exactly like any sub-allocator.
  at::Tensor tensor(int64_t offset, int64_t numel, at::ScalarType dtype) {
    std::lock_guard<std::mutex> lock(mu_);
    check_open("tensor");
    TORCH_CHECK(numel >= 0, "mfsdp_ext SymmComm.tensor: numel must be >= 0, got ", numel);
    const int64_t nbytes = numel * (int64_t)c10::elementSize(dtype);
    TORCH_CHECK(offset % (int64_t)c10::elementSize(dtype) == 0, "mfsdp_ext SymmComm.tensor: offset ", offset,
                " is not aligned to the element size of ", dtype);
    TORCH_CHECK(alloc_.find_allocation(offset, nbytes) >= 0, "mfsdp_ext SymmComm.tensor: [", offset, ", ",
                offset + nbytes, ") is not inside a live allocation of this pool");
    const Slot& s = slots_.at(alloc_.region_index(offset));
    void* ptr = static_cast<char*>(s.mem->base) + (offset - s.begin);
    std::shared_ptr<NcclRegion> keep = s.mem;
    return torch::from_blob(
        ptr, {numel}, [keep](void*) mutable { keep.reset(); },
        at::TensorOptions().dtype(dtype).device(cuda_device(device_)));
  }

  // Pool offset of t's first byte if t lies entirely inside a registered window, else -1.
  int64_t offset_of(const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mu_);
    return locate(t);
  }

  bool contains(const at::Tensor& t) { return offset_of(t) >= 0; }

  // ---- collectives ---------------------------------------------------------------------------

  // Checks shared by the collectives: `shard` (n elements) and `full` (world * n elements) are contiguous
  // tensors of one dtype on this device inside this pool's windows, and `shard` is either this rank's slot
  // of `full` (in place) or apart from it.
  void check_shard_and_full(const char* op, const at::Tensor& shard, const char* shard_name, const at::Tensor& full,
                            const char* full_name) const {
    check_tensor(shard, op, shard_name);
    check_tensor(full, op, full_name);
    TORCH_CHECK(shard.scalar_type() == full.scalar_type(), "mfsdp_ext SymmComm.", op, ": ", shard_name, " dtype ",
                shard.scalar_type(), " != ", full_name, " dtype ", full.scalar_type());
    TORCH_CHECK(full.numel() == shard.numel() * world_, "mfsdp_ext SymmComm.", op, ": ", full_name, " has ",
                full.numel(), " elements, expected world_size * ", shard_name, ".numel() = ", world_, " * ",
                shard.numel());
    check_in_window(shard, op, shard_name);
    check_in_window(full, op, full_name);
    const int64_t shard_bytes = (int64_t)shard.nbytes();
    const uintptr_t shard_p = reinterpret_cast<uintptr_t>(shard.data_ptr());
    const uintptr_t full_p = reinterpret_cast<uintptr_t>(full.data_ptr());
    const bool in_place = shard_p == full_p + (uintptr_t)(rank_ * shard_bytes);
    TORCH_CHECK(in_place || !bytes_overlap(shard.data_ptr(), shard_bytes, full.data_ptr(), (int64_t)full.nbytes()),
                "mfsdp_ext SymmComm.", op, ": ", shard_name, " overlaps ", full_name,
                " but is not this rank's slot (", full_name, "[rank * n : (rank + 1) * n])");
  }


  // output = concat over ranks of input (ncclAllGather). In place when input is output's slice for this rank
  // (input.data_ptr == output.data_ptr + rank * input.nbytes). Both must be contiguous, on this communicator's
  // device, of the same dtype, inside this pool's windows; output.numel == world * input.numel.
  void all_gather(const at::Tensor& input, const at::Tensor& output) {
    std::lock_guard<std::mutex> lock(mu_);
    check_open("all_gather");
    check_shard_and_full("all_gather", input, "input", output, "output");
    if (input.numel() == 0) return;
    ncclDataType_t type;
    size_t count;
    gather_type(input.scalar_type(), input.numel(), &type, &count);
    c10::DeviceGuard guard(cuda_device(device_));
    cudaStream_t stream = current_stream();
    MFSDP_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), count, type, comm_, stream), comm_);
  }

  // output = sum over ranks of input[rank * n : (rank + 1) * n] (ncclReduceScatter, ncclSum), then, when
  // scale_by_inverse_world, output *= 1 / world on the same stream. bf16/fp16/fp32. In place when output is
  // input's slice for this rank. Both contiguous, same device/dtype, inside this pool's windows;
  // input.numel == world * output.numel.
  void reduce_scatter(const at::Tensor& input, const at::Tensor& output, bool scale_by_inverse_world) {
    std::lock_guard<std::mutex> lock(mu_);
    check_open("reduce_scatter");
    check_shard_and_full("reduce_scatter", output, "output", input, "input");
    const ncclDataType_t type = reduce_type(input.scalar_type());
    if (output.numel() == 0) return;
    c10::DeviceGuard guard(cuda_device(device_));
    cudaStream_t stream = current_stream();
    MFSDP_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), (size_t)output.numel(), type, ncclSum,
                                       comm_, stream),
                     comm_);
    if (scale_by_inverse_world && world_ > 1) {
      // Runs on torch's current stream of this device, i.e. the stream NCCL was given above.
      output.mul_(1.0 / (double)world_);
    }
  }

  // ---- teardown ------------------------------------------------------------------------------

  // Collective and idempotent: waits for the device, deregisters every window (creation order), releases
  // the pool, destroys the communicator if this object created it.
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    if (comm_ != nullptr) {
      c10::DeviceGuard guard(cuda_device(device_));
      c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).synchronizeDevice((c10::DeviceIndex)device_);
      for (auto& s : slots_) {
        if (s.win == nullptr) continue;
        ncclWindow_t w = s.win;
        s.win = nullptr;  // never retried, even if this throws
        ncclResult_t r = ncclCommWindowDeregister(comm_, w);
        if (r == ncclInProgress) r = wait_ready(comm_);
        if (r != ncclSuccess) {
          s.mem->leak = true;
          throw_nccl("ncclCommWindowDeregister(comm, window)", r, comm_);
        }
      }
      slots_.clear();  // memory is freed once no tensor view holds it
      if (owns_) {
        ncclComm_t c = comm_;
        comm_ = nullptr;
        ncclResult_t r = ncclCommFinalize(c);
        if (r == ncclInProgress) r = wait_ready(c);
        if (r != ncclSuccess) {
          ncclCommAbort(c);
          throw_nccl("ncclCommFinalize(comm)", r, nullptr);
        }
        MFSDP_NCCL_CHECK(ncclCommDestroy(c), (ncclComm_t) nullptr);
      }
      comm_ = nullptr;
    }
    slots_.clear();
    closed_ = true;
  }

  // Local and idempotent: forget the communicator without any NCCL call (for when it is already gone, e.g.
  // the process group was destroyed first). Windows and their memory are leaked on purpose.
  void abandon() {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    for (auto& s : slots_) s.mem->leak = true;
    slots_.clear();
    comm_ = nullptr;
    closed_ = true;
  }

  // ---- properties ----------------------------------------------------------------------------
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int device() const { return device_; }
  bool owns_comm() const { return owns_; }
  bool closed() const { return closed_; }
  int64_t comm_ptr() const { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(comm_)); }
  int64_t grow_bytes() const { return grow_bytes_; }
  void set_grow_bytes(int64_t b) {
    TORCH_CHECK(b > 0, "mfsdp_ext SymmComm.grow_bytes must be > 0");
    grow_bytes_ = b;
  }
  int64_t capacity() {
    std::lock_guard<std::mutex> lock(mu_);
    return alloc_.capacity();
  }
  int64_t bytes_in_use() {
    std::lock_guard<std::mutex> lock(mu_);
    return alloc_.used();
  }

  py::dict stats() {
    std::lock_guard<std::mutex> lock(mu_);
    py::dict d;
    d["capacity"] = alloc_.capacity();
    d["bytes_in_use"] = alloc_.used();
    d["largest_free"] = alloc_.largest_free();
    d["num_allocations"] = alloc_.num_allocations();
    py::list regions;
    for (const auto& s : slots_) {
      py::dict r;
      r["offset"] = s.begin;
      r["bytes"] = s.bytes;
      r["ptr"] = (int64_t) reinterpret_cast<uintptr_t>(s.mem->base);
      r["registered"] = s.win != nullptr;
      regions.append(r);
    }
    d["regions"] = regions;
    return d;
  }

 private:
  struct Slot {
    std::shared_ptr<NcclRegion> mem;
    ncclWindow_t win = nullptr;
    int64_t begin = 0;  // pool offset of mem->base
    int64_t bytes = 0;
  };

  void query_comm() {
    int dev = -1, rank = -1, n = -1;
    MFSDP_NCCL_CHECK(ncclCommCuDevice(comm_, &dev), comm_);
    MFSDP_NCCL_CHECK(ncclCommUserRank(comm_, &rank), comm_);
    MFSDP_NCCL_CHECK(ncclCommCount(comm_, &n), comm_);
    device_ = dev;
    rank_ = rank;
    world_ = n;
  }

  void check_open(const char* what) const {
    TORCH_CHECK(!closed_, "mfsdp_ext SymmComm.", what, ": the communicator/pool is closed");
  }

  cudaStream_t current_stream() const {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    c10::Stream s = impl.getStream(cuda_device(device_));
    return static_cast<cudaStream_t>(impl.getStreamNativeHandle(s));
  }

  int64_t reserve_locked(int64_t nbytes) {
    TORCH_CHECK(nbytes > 0, "mfsdp_ext SymmComm.reserve: nbytes must be > 0, got ", nbytes);
    const int64_t bytes = round_up(nbytes, kRegionGranularity);
    auto mem = std::make_shared<NcclRegion>();
    mem->device = device_;
    c10::DeviceGuard guard(cuda_device(device_));
    {
      void* p = nullptr;
      MFSDP_NCCL_CHECK(ncclMemAlloc(&p, (size_t)bytes), (ncclComm_t) nullptr);
      mem->base = p;
    }
    ncclWindow_t win = nullptr;
    ncclResult_t r = ncclCommWindowRegister(comm_, mem->base, (size_t)bytes, &win, NCCL_WIN_COLL_SYMMETRIC);
    if (r == ncclInProgress) r = wait_ready(comm_);
    if (r != ncclSuccess) throw_nccl("ncclCommWindowRegister(comm, ptr, size, &win, NCCL_WIN_COLL_SYMMETRIC)", r, comm_);
    TORCH_CHECK(win != nullptr,
                "mfsdp_ext SymmComm.reserve: ncclCommWindowRegister returned no window: this communicator has no "
                "symmetric-memory support (ranks not all on one node with direct NVLink, cuMem disabled via "
                "NCCL_CUMEM_ENABLE=0, or NCCL_LOCAL_REGISTER=0)");
    Slot s;
    s.mem = std::move(mem);
    s.win = win;
    s.bytes = bytes;
    s.begin = alloc_.add_region(bytes);
    slots_.push_back(std::move(s));
    return slots_.back().begin;
  }

  int64_t locate(const at::Tensor& t) const {
    if (!t.defined() || !t.is_cuda() || t.get_device() != device_) return -1;
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t n = (uintptr_t)t.nbytes();
    for (const auto& s : slots_) {
      if (s.win == nullptr) continue;
      const uintptr_t b = reinterpret_cast<uintptr_t>(s.mem->base);
      if (p >= b && p + n <= b + (uintptr_t)s.bytes) return s.begin + (int64_t)(p - b);
    }
    return -1;
  }

  void check_tensor(const at::Tensor& t, const char* op, const char* name) const {
    TORCH_CHECK(t.defined(), "mfsdp_ext SymmComm.", op, ": ", name, " is undefined");
    TORCH_CHECK(t.is_cuda() && t.get_device() == device_, "mfsdp_ext SymmComm.", op, ": ", name, " is on ",
                t.device(), " but the communicator is on cuda:", device_);
    TORCH_CHECK(t.is_contiguous(), "mfsdp_ext SymmComm.", op, ": ", name, " must be contiguous");
  }

  void check_in_window(const at::Tensor& t, const char* op, const char* name) const {
    TORCH_CHECK(locate(t) >= 0, "mfsdp_ext SymmComm.", op, ": ", name, " (", t.data_ptr(), ", ", t.nbytes(),
                " bytes) is not inside this pool's symmetric window; allocate it with alloc()/tensor() "
                "(use the plain torch.distributed path for other tensors)");
  }

  ncclComm_t comm_ = nullptr;
  bool owns_ = false;
  bool closed_ = false;
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

void mfsdp_register_symm_comm(pybind11::module_& m) {
  using mfsdp::symm::OffsetAllocator;

  m.def(
      "nccl_version",
      []() -> int {
#if defined(MFSDP_WITH_NCCL)
        int v = 0;
        ncclResult_t r = ncclGetVersion(&v);
        TORCH_CHECK(r == ncclSuccess, "mfsdp_ext: ncclGetVersion failed: ", ncclGetErrorString(r));
        return v;
#else
        return 0;
#endif
      },
      "Version code of the NCCL library loaded at run time (e.g. 22809 for 2.28.9); 0 when built without NCCL.");

  m.def(
      "symm_comm_build_info",
      []() {
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
        d["min_runtime_version"] = mfsdp::symm::kMinRuntimeVersion;
        d["alignment"] = mfsdp::symm::kAlignment;
        return d;
      },
      "Whether the symmetric-memory communicator (SymmComm) was compiled in, and why not.");

  py::class_<OffsetAllocator>(m, "SymmOffsetAllocator",
                              "Deterministic first-fit offset allocator behind SymmComm's pool (bookkeeping only).")
      .def(py::init<int64_t>(), py::arg("alignment") = mfsdp::symm::kAlignment)
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

#if defined(MFSDP_SYMM_COMM_ENABLED)
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
      .def_static("unique_id", &SymmComm::unique_id, "A fresh ncclUniqueId as bytes (call on one rank).")
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
      .def("close", &SymmComm::close, release(), "Collective, idempotent teardown.")
      .def("abandon", &SymmComm::abandon,
           "Mark closed without NCCL calls (the communicator is already gone); leaks the windows' memory.")
      .def("stats", &SymmComm::stats)
      .def_property_readonly("rank", &SymmComm::rank)
      .def_property_readonly("world_size", &SymmComm::world_size)
      .def_property_readonly("device", &SymmComm::device)
      .def_property_readonly("owns_comm", &SymmComm::owns_comm)
      .def_property_readonly("closed", &SymmComm::closed)
      .def_property_readonly("comm_ptr", &SymmComm::comm_ptr)
      .def_property_readonly("capacity", &SymmComm::capacity)
      .def_property_readonly("bytes_in_use", &SymmComm::bytes_in_use)
      .def_property("grow_bytes", &SymmComm::grow_bytes, &SymmComm::set_grow_bytes)
      .def_property_readonly_static("alignment", [](py::object) { return mfsdp::symm::kAlignment; });
#endif
}
