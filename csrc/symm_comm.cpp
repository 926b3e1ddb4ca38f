// SymmComm (see symm_comm.h): the NCCL communicator, its symmetric-memory pool and collectives. Compiled to
// nothing without NCCL >= 2.27 headers.
#include "symm_comm.h"

#if defined(MFSDP_SYMM_COMM_ENABLED)

#include <torch/types.h>  // torch::from_blob

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "tensor_checks.h"  // bytes_overlap

namespace mfsdp {
namespace symm {

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

// issue(i) for every i in [0, n) inside one NCCL group (ncclGroupStart / End): the grouped collectives. A call
// that fails closes the group before the error (named by `calls`) is reported: the communicator stays usable.
template <class Issue>
static void nccl_group(ncclComm_t comm, size_t n, const char* calls, Issue&& issue) {
  MFSDP_NCCL_CHECK(ncclGroupStart(), comm);
  for (size_t i = 0; i < n; ++i) {
    const ncclResult_t r = issue(i);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      throw_nccl(calls, r, comm);
    }
  }
  MFSDP_NCCL_CHECK(ncclGroupEnd(), comm);
}

static int runtime_nccl_version() {
  int v = 0;
  ncclResult_t r = ncclGetVersion(&v);
  if (r != ncclSuccess) throw_nccl("ncclGetVersion(&version)", r, nullptr);
  return v;
}

static void require_runtime_version() {
  const int v = runtime_nccl_version();
  TORCH_CHECK(v >= kMinNcclVersion, "mfsdp_ext SymmComm: the loaded NCCL library is ", version_string(v),
              " but symmetric-memory collectives need NCCL >= ", version_string(kMinNcclVersion),
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
// SymmComm: construction and destruction
// ----------------------------------------------------------------------------------------------
SymmComm::SymmComm(int64_t comm_ptr) : alloc_(kWindowAlignment) {
  TORCH_CHECK(comm_ptr != 0,
              "mfsdp_ext SymmComm: comm_ptr is 0 (the ProcessGroupNCCL communicator does not exist yet; "
              "init the group with init_process_group(\"nccl\", device_id=...) or run one collective first)");
  require_runtime_version();
  comm_ = reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(comm_ptr));
  owns_ = false;
  query_comm();
}

SymmComm::SymmComm(const std::string& unique_id, int rank, int world_size, int device) : alloc_(kWindowAlignment) {
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

SymmComm::~SymmComm() {
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
  if ((windows > 0 || owns_) && !kept_until_exit_) {
    std::fprintf(stderr,
                 "mfsdp_ext SymmComm: destroyed without close(); %s%zu symmetric window(s) (%lld bytes) stay "
                 "until the process exits. Call close() (or release_symmetric_memory() on a fully_shard "
                 "root) on every rank to free them.\n",
                 owns_ ? "its own NCCL communicator and " : "", windows, (long long)alloc_.capacity());
  }
  comm_ = nullptr;
  slots_.clear();
}

std::string SymmComm::unique_id() {
  ncclUniqueId id;
  MFSDP_NCCL_CHECK(ncclGetUniqueId(&id), (ncclComm_t) nullptr);
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

// ----------------------------------------------------------------------------------------------
// pool
// ----------------------------------------------------------------------------------------------
int64_t SymmComm::reserve(int64_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("reserve");
  return reserve_locked(nbytes);
}

int64_t SymmComm::alloc(int64_t nbytes, bool grow) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("alloc");
  TORCH_CHECK(nbytes >= 0, "mfsdp_ext SymmComm.alloc: nbytes must be >= 0, got ", nbytes);
  int64_t off = alloc_.alloc(nbytes);
  if (off >= 0) return off;
  TORCH_CHECK(grow, "mfsdp_ext SymmComm.alloc: symmetric pool exhausted (", nbytes, " bytes requested, ",
              alloc_.capacity() - alloc_.used(), " of ", alloc_.capacity(), " bytes free, largest free block ",
              alloc_.largest_free(), "); reserve() more or pass grow=True");
  reserve_locked(std::max<int64_t>(round_up(std::max<int64_t>(nbytes, 1), kWindowAlignment), grow_bytes_));
  off = alloc_.alloc(nbytes);
  TORCH_CHECK(off >= 0, "mfsdp_ext SymmComm.alloc: internal error, a fresh region did not fit ", nbytes,
              " bytes");
  return off;
}

void SymmComm::free(int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  alloc_.free(offset);
}

at::Tensor SymmComm::tensor(int64_t offset, int64_t numel, at::ScalarType dtype) {
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

int64_t SymmComm::offset_of(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  return locate(t);
}

// ----------------------------------------------------------------------------------------------
// collectives
// ----------------------------------------------------------------------------------------------
// Checks shared by the collectives: `shard` (n elements) and `full` (world * n elements) are contiguous
// tensors of one dtype on this device inside this pool's windows, and `shard` is either this rank's slot
// of `full` (in place) or apart from it.
void SymmComm::check_shard_and_full(const char* op, const at::Tensor& shard, const char* shard_name,
                                    const at::Tensor& full, const char* full_name, bool in_pool) const {
  check_tensor(shard, op, shard_name);
  check_tensor(full, op, full_name);
  TORCH_CHECK(shard.scalar_type() == full.scalar_type(), "mfsdp_ext SymmComm.", op, ": ", shard_name, " dtype ",
              shard.scalar_type(), " != ", full_name, " dtype ", full.scalar_type());
  TORCH_CHECK(full.numel() == shard.numel() * world_, "mfsdp_ext SymmComm.", op, ": ", full_name, " has ",
              full.numel(), " elements, expected world_size * ", shard_name, ".numel() = ", world_, " * ",
              shard.numel());
  if (in_pool) {
    check_in_window(shard, op, shard_name);
    check_in_window(full, op, full_name);
  }
  const int64_t shard_bytes = (int64_t)shard.nbytes();
  const uintptr_t shard_p = reinterpret_cast<uintptr_t>(shard.data_ptr());
  const uintptr_t full_p = reinterpret_cast<uintptr_t>(full.data_ptr());
  const bool in_place = shard_p == full_p + (uintptr_t)(rank_ * shard_bytes);
  TORCH_CHECK(in_place || !bytes_overlap(shard.data_ptr(), shard_bytes, full.data_ptr(), (int64_t)full.nbytes()),
              "mfsdp_ext SymmComm.", op, ": ", shard_name, " overlaps ", full_name,
              " but is not this rank's slot (", full_name, "[rank * n : (rank + 1) * n])");
}

void SymmComm::all_gather(const at::Tensor& input, const at::Tensor& output) {
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

void SymmComm::reduce_scatter(const at::Tensor& input, const at::Tensor& output, bool scale_by_inverse_world) {
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

void SymmComm::grouped_all_gather(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("grouped_all_gather");
  TORCH_CHECK(inputs.size() == outputs.size(), "mfsdp_ext SymmComm.grouped_all_gather: ", inputs.size(),
              " inputs but ", outputs.size(), " outputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_shard_and_full("grouped_all_gather", inputs[i], "inputs[i]", outputs[i], "outputs[i]", false);
  }
  c10::DeviceGuard guard(cuda_device(device_));
  cudaStream_t stream = current_stream();
  nccl_group(comm_, inputs.size(), "ncclAllGather(input, output, count, type, comm, stream)", [&](size_t i) {
    if (inputs[i].numel() == 0) return ncclSuccess;
    ncclDataType_t type;
    size_t count;
    gather_type(inputs[i].scalar_type(), inputs[i].numel(), &type, &count);
    return ncclAllGather(inputs[i].data_ptr(), outputs[i].data_ptr(), count, type, comm_, stream);
  });
}

void SymmComm::flat_reduce_scatter(const at::Tensor& input, const at::Tensor& output) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("flat_reduce_scatter");
  check_shard_and_full("flat_reduce_scatter", output, "output", input, "input", false);
  const ncclDataType_t type = reduce_type(input.scalar_type());
  if (output.numel() == 0) return;
  c10::DeviceGuard guard(cuda_device(device_));
  MFSDP_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), (size_t)output.numel(), type, ncclSum,
                                     comm_, current_stream()),
                   comm_);
}

void SymmComm::grouped_reduce_scatter(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("grouped_reduce_scatter");
  TORCH_CHECK(inputs.size() == outputs.size(), "mfsdp_ext SymmComm.grouped_reduce_scatter: ", inputs.size(),
              " inputs but ", outputs.size(), " outputs");
  std::vector<ncclDataType_t> types;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_shard_and_full("grouped_reduce_scatter", outputs[i], "outputs[i]", inputs[i], "inputs[i]", false);
    types.push_back(reduce_type(inputs[i].scalar_type()));
  }
  c10::DeviceGuard guard(cuda_device(device_));
  cudaStream_t stream = current_stream();
  nccl_group(comm_, inputs.size(), "ncclReduceScatter(input, output, count, type, ncclSum, comm, stream)",
             [&](size_t i) {
               if (outputs[i].numel() == 0) return ncclSuccess;
               return ncclReduceScatter(inputs[i].data_ptr(), outputs[i].data_ptr(), (size_t)outputs[i].numel(),
                                        types[i], ncclSum, comm_, stream);
             });
}

void SymmComm::all_to_all(const at::Tensor& input, const at::Tensor& output) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("all_to_all");
  check_tensor(input, "all_to_all", "input");
  check_tensor(output, "all_to_all", "output");
  TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.numel() == output.numel() &&
                  input.numel() % world_ == 0,
              "mfsdp_ext SymmComm.all_to_all: input and output must have one dtype and one numel divisible by the ",
              "world size ", world_, ", got ", input.scalar_type(), " ", input.numel(), " and ", output.scalar_type(),
              " ", output.numel());
  TORCH_CHECK(!bytes_overlap(input.data_ptr(), (int64_t)input.nbytes(), output.data_ptr(), (int64_t)output.nbytes()),
              "mfsdp_ext SymmComm.all_to_all: input and output must not overlap");
  if (input.numel() == 0) return;
  ncclDataType_t type;
  size_t count;
  gather_type(input.scalar_type(), input.numel() / world_, &type, &count);
  const size_t part_bytes = (size_t)input.nbytes() / (size_t)world_;
  const char* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  c10::DeviceGuard guard(cuda_device(device_));
  cudaStream_t stream = current_stream();
  nccl_group(comm_, (size_t)world_, "ncclSend / ncclRecv(part, count, type, peer, comm, stream)", [&](size_t peer) {
    const ncclResult_t r = ncclSend(in + peer * part_bytes, count, type, (int)peer, comm_, stream);
    return r == ncclSuccess ? ncclRecv(out + peer * part_bytes, count, type, (int)peer, comm_, stream) : r;
  });
}

void SymmComm::all_reduce_max(const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("all_reduce_max");
  check_tensor(tensor, "all_reduce_max", "tensor");
  TORCH_CHECK(tensor.scalar_type() == at::kFloat, "mfsdp_ext SymmComm.all_reduce_max: tensor must be float32, got ",
              tensor.scalar_type());
  if (tensor.numel() == 0) return;
  c10::DeviceGuard guard(cuda_device(device_));
  MFSDP_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), (size_t)tensor.numel(), ncclFloat32, ncclMax,
                                 comm_, current_stream()),
                   comm_);
}

// ----------------------------------------------------------------------------------------------
// teardown
// ----------------------------------------------------------------------------------------------
void SymmComm::close() {
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

void SymmComm::abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  for (auto& s : slots_) s.mem->leak = true;
  slots_.clear();
  comm_ = nullptr;
  closed_ = true;
}

// ----------------------------------------------------------------------------------------------
// properties
// ----------------------------------------------------------------------------------------------
void SymmComm::set_grow_bytes(int64_t b) {
  TORCH_CHECK(b > 0, "mfsdp_ext SymmComm.grow_bytes must be > 0");
  grow_bytes_ = b;
}

int64_t SymmComm::capacity() {
  std::lock_guard<std::mutex> lock(mu_);
  return alloc_.capacity();
}

int64_t SymmComm::bytes_in_use() {
  std::lock_guard<std::mutex> lock(mu_);
  return alloc_.used();
}

PoolStats SymmComm::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats st;
  st.capacity = alloc_.capacity();
  st.bytes_in_use = alloc_.used();
  st.largest_free = alloc_.largest_free();
  st.num_allocations = alloc_.num_allocations();
  for (const auto& s : slots_) {
    st.regions.push_back(
        PoolStats::Region{s.begin, s.bytes, (int64_t) reinterpret_cast<uintptr_t>(s.mem->base), s.win != nullptr});
  }
  return st;
}

// ----------------------------------------------------------------------------------------------
// private helpers
// ----------------------------------------------------------------------------------------------
void SymmComm::query_comm() {
  int dev = -1, rank = -1, n = -1;
  MFSDP_NCCL_CHECK(ncclCommCuDevice(comm_, &dev), comm_);
  MFSDP_NCCL_CHECK(ncclCommUserRank(comm_, &rank), comm_);
  MFSDP_NCCL_CHECK(ncclCommCount(comm_, &n), comm_);
  device_ = dev;
  rank_ = rank;
  world_ = n;
}

void SymmComm::check_open(const char* what) const {
  TORCH_CHECK(!closed_, "mfsdp_ext SymmComm.", what, ": the communicator/pool is closed");
}

cudaStream_t SymmComm::current_stream() const {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  c10::Stream s = impl.getStream(cuda_device(device_));
  return static_cast<cudaStream_t>(impl.getStreamNativeHandle(s));
}

int64_t SymmComm::reserve_locked(int64_t nbytes) {
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

int64_t SymmComm::locate(const at::Tensor& t) const {
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

void SymmComm::check_tensor(const at::Tensor& t, const char* op, const char* name) const {
  TORCH_CHECK(t.defined(), "mfsdp_ext SymmComm.", op, ": ", name, " is undefined");
  TORCH_CHECK(t.is_cuda() && t.get_device() == device_, "mfsdp_ext SymmComm.", op, ": ", name, " is on ",
              t.device(), " but the communicator is on cuda:", device_);
  TORCH_CHECK(t.is_contiguous(), "mfsdp_ext SymmComm.", op, ": ", name, " must be contiguous");
}

void SymmComm::check_in_window(const at::Tensor& t, const char* op, const char* name) const {
  TORCH_CHECK(locate(t) >= 0, "mfsdp_ext SymmComm.", op, ": ", name, " (", t.data_ptr(), ", ", t.nbytes(),
              " bytes) is not inside this pool's symmetric window; allocate it with alloc()/tensor() "
              "(use the plain torch.distributed path for other tensors)");
}

}  // namespace symm
}  // namespace mfsdp

#endif  // MFSDP_SYMM_COMM_ENABLED
