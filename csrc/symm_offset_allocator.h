// The deterministic offset allocator behind SymmComm's symmetric-memory pool: pure bookkeeping (no CUDA, no
// NCCL), so every build has it and it is unit-tested on the CPU.
//
// Offsets live in one "pool space": region k covers [begin_k, begin_k + bytes_k), regions are laid out back to
// back in creation order. Allocation is first fit by lowest offset, sizes are rounded up to the alignment, frees
// coalesce with free neighbours in the same region; blocks never span regions. The same sequence of calls on
// every rank therefore gives the same offsets, which is what NCCL's symmetric kernels need.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace mfsdp {
namespace symm {

// Offset granularity of every sub-allocation: NCCL wants window offsets 4096-aligned for its symmetric kernels.
constexpr int64_t kWindowAlignment = 4096;

inline int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

class OffsetAllocator {
 public:
  explicit OffsetAllocator(int64_t alignment = kWindowAlignment);

  // Appends a region of `bytes` (rounded up to the alignment); returns its first offset.
  int64_t add_region(int64_t bytes);
  // Returns the offset, or -1 when no region has a free block that fits.
  int64_t alloc(int64_t bytes);
  void free(int64_t offset);
  // Start of the live allocation that contains [offset, offset + bytes), or -1.
  int64_t find_allocation(int64_t offset, int64_t bytes) const;
  int region_index(int64_t offset) const;
  int64_t largest_free() const;
  std::vector<std::pair<int64_t, int64_t>> allocations() const;  // (offset, size) of every live allocation

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

}  // namespace symm
}  // namespace mfsdp
