// OffsetAllocator (see symm_offset_allocator.h).
#include "symm_offset_allocator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>

namespace mfsdp {
namespace symm {

OffsetAllocator::OffsetAllocator(int64_t alignment) : alignment_(alignment) {
  TORCH_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0,
              "SymmOffsetAllocator: alignment must be a power of two, got ", alignment);
}

int64_t OffsetAllocator::add_region(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "SymmOffsetAllocator.add_region: bytes must be > 0, got ", bytes);
  Region r;
  r.begin = capacity_;
  r.bytes = round_up(bytes, alignment_);
  r.free.emplace(r.begin, r.bytes);
  capacity_ += r.bytes;
  regions_.push_back(std::move(r));
  return regions_.back().begin;
}

int64_t OffsetAllocator::alloc(int64_t bytes) {
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

void OffsetAllocator::free(int64_t offset) {
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

int64_t OffsetAllocator::find_allocation(int64_t offset, int64_t bytes) const {
  auto it = allocated_.upper_bound(offset);
  if (it == allocated_.begin()) return -1;
  --it;
  const int64_t end = it->first + it->second;
  if (offset < end && offset + std::max<int64_t>(bytes, 0) <= end) return it->first;
  return -1;
}

int OffsetAllocator::region_index(int64_t offset) const {
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (offset >= regions_[i].begin && offset < regions_[i].begin + regions_[i].bytes) return (int)i;
  }
  TORCH_CHECK(false, "SymmOffsetAllocator: offset ", offset, " is outside every region");
  return -1;
}

int64_t OffsetAllocator::largest_free() const {
  int64_t best = 0;
  for (const auto& r : regions_)
    for (const auto& kv : r.free) best = std::max(best, kv.second);
  return best;
}

std::vector<std::pair<int64_t, int64_t>> OffsetAllocator::allocations() const {
  return {allocated_.begin(), allocated_.end()};
}

}  // namespace symm
}  // namespace mfsdp
