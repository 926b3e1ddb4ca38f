// host_max_agree (host_agree.h). Each rank writes its values for sequence number seq into the half of its slot that
// seq's parity selects, then publishes seq with a release store; readers wait for seq with acquire loads, then read
// that half. A rank at seq + 1 writes the other half, and cannot reach seq + 2 (the same half again) before every
// rank has published seq + 1, i.e. has finished reading seq's values: no value is overwritten while still read.
#include "host_agree.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace mfsdp {

namespace {

void check_inputs(const at::Tensor& slots, int64_t rank, int64_t world, int64_t seq, const at::Tensor& values) {
  TORCH_CHECK_VALUE(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                        slots.numel() >= world * kAgreeRankWords,
                    "mfsdp_ext.host_max_agree: slots must be a contiguous CPU int64 tensor of at least world x ",
                    kAgreeRankWords, " words, got ", slots.scalar_type(), " ", slots.sizes(), " on ", slots.device());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(slots.data_ptr()) % alignof(int64_t) == 0,
                    "mfsdp_ext.host_max_agree: slots must be 8-byte aligned");
  TORCH_CHECK_VALUE(world >= 1 && rank >= 0 && rank < world && seq >= 1,
                    "mfsdp_ext.host_max_agree: need 0 <= rank < world and seq >= 1, got rank ", rank, ", world ",
                    world, ", seq ", seq);
  TORCH_CHECK_VALUE(values.device().is_cpu() && values.scalar_type() == at::kLong && values.is_contiguous() &&
                        values.numel() >= 1 && values.numel() <= kAgreeMaxValues,
                    "mfsdp_ext.host_max_agree: values must be a contiguous CPU int64 tensor of 1 to ", kAgreeMaxValues,
                    " elements, got ", values.scalar_type(), " ", values.sizes());
}

}  // namespace

void host_max_agree(const at::Tensor& slots, int64_t rank, int64_t world, int64_t seq, const at::Tensor& values,
                    double timeout_s) {
  check_inputs(slots, rank, world, seq, values);
  int64_t* base = slots.data_ptr<int64_t>();
  int64_t* mine = values.data_ptr<int64_t>();
  const int64_t n = values.numel();
  const int64_t half = 8 + 8 * (seq % 2);
  int64_t* own = base + rank * kAgreeRankWords;
  for (int64_t i = 0; i < n; ++i) __atomic_store_n(own + half + i, mine[i], __ATOMIC_RELAXED);
  __atomic_store_n(own, seq, __ATOMIC_RELEASE);

  std::vector<int64_t> result(mine, mine + n);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t other = 0; other < world; ++other) {
    if (other == rank) continue;
    const int64_t* slot = base + other * kAgreeRankWords;
    // spin briefly (the ranks arrive within microseconds of each other), then yield the core: more ranks than
    // cores must still make progress
    for (int64_t spins = 0; __atomic_load_n(slot, __ATOMIC_ACQUIRE) < seq; ++spins) {
      if (spins < 2000) continue;
      std::this_thread::yield();
      if ((spins & 1023) == 0 && std::chrono::steady_clock::now() > deadline) {
        TORCH_CHECK(false, "mfsdp_ext.graphed: rank ", other, " did not reach decision ", seq, " within ", timeout_s,
                    " s (rank ", rank, " waits); every rank must call the graphed step the same number of times");
      }
    }
    for (int64_t i = 0; i < n; ++i) result[i] = std::max(result[i], __atomic_load_n(slot + half + i, __ATOMIC_RELAXED));
  }
  std::copy(result.begin(), result.end(), mine);
}

}  // namespace mfsdp
