// Entry points of pack / pack_pieces / unpack: check the tensors, build a list of copy entries (length, source,
// destination; a null source writes zeros) per source / destination dtype, and run each list as one kernel
// over a copy table (launch.h; kernels: pack_cpu.cpp, pack_cuda.cu). On CUDA the table travels in the kernel's
// parameters up to kInlineTableEntries entries and is uploaded above that.
#include "pack.h"

#include <algorithm>
#include <array>
#include <string>

#include "device_launch.h"
#include "tensor_checks.h"

namespace mfsdp {
namespace {

struct Entry {
  int64_t len;
  const void* src;  // nullptr: write zeros
  void* dst;
};

// The copy table of `entries` (layout: launch.h) in host memory.
std::vector<int64_t> make_copy_table(const std::vector<Entry>& entries) {
  const int64_t n = static_cast<int64_t>(entries.size());
  std::vector<int64_t> table(copy_table_words(n));
  table[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    table[i + 1] = table[i] + entries[i].len;
    table[n + 1 + i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(entries[i].src));
    table[2 * n + 1 + i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(entries[i].dst));
  }
  return table;
}

// Runs all entries (source dtype `in`, destination dtype `out`, on like's device) as one kernel.
void run_entries(const std::vector<Entry>& entries, DType in, DType out, float scale, bool use_scale,
                 const at::Tensor& like, const char* fn) {
  const int64_t n = static_cast<int64_t>(entries.size());
  if (n == 0) return;
  const std::vector<int64_t> table = make_copy_table(entries);
  CopyTableParams p{table.data(), nullptr, n, table[n], in, out, scale, use_scale};
  if (p.total == 0) return;
#ifdef MFSDP_WITH_CUDA
  at::Tensor device_table;  // alive until the kernel is queued; the allocator orders its reuse after it
  if (like.is_cuda() && n > kInlineTableEntries) {
    const std::string what = "more than " + std::to_string(kInlineTableEntries) + " tensors";
    device_table = upload_table({{table.data(), table.size() * sizeof(int64_t)}}, like, fn, what.c_str());
    p.device_table = device_table.data_ptr<int64_t>();
  }
#endif
  run_kernel(like, fn, p);
}

DType tensor_dtype(const at::Tensor& t, const char* fn, const char* list, size_t i) {
  DType d;
  TORCH_CHECK_TYPE(to_dtype(t.scalar_type(), d) && is_float_dtype(d), "mfsdp_ext.", fn, ": ", list, "[", i,
              "] must be float32, bfloat16 or float16, got ", t.scalar_type());
  return d;
}

// One source range to copy into out: `len` elements of dtype `dtype` at `ptr`, landing at out[off].
struct Item {
  int64_t off, len;
  size_t idx;  // which tensor (pack) or piece (pack_pieces) it came from, for error messages
  const void* ptr;
  DType dtype;
};

// out[item.off : item.off + item.len] = cast(item * scale) for every item, zeros elsewhere: sorts the items,
// rejects overlaps, and runs one pass per source dtype (the gaps go with the first one).
void pack_items(std::vector<Item>& items, const at::Tensor& out, double scale, const char* fn, const char* what) {
  const DType od = float_dtype(out, fn, "out");
  if (out.is_meta()) return;
  const int64_t total = out.numel();
  const int64_t osz = out.element_size();
  char* out_ptr = static_cast<char*>(out.data_ptr());
  auto by_off = [](const Item& a, const Item& b) { return a.off < b.off; };
  if (!std::is_sorted(items.begin(), items.end(), by_off)) std::stable_sort(items.begin(), items.end(), by_off);

  std::array<std::vector<Entry>, 3> groups;
  int first_group = items.empty() ? static_cast<int>(kF32) : static_cast<int>(items[0].dtype);
  int64_t cur = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    const Item& it = items[k];
    if (it.off < cur) {
      const Item& prev = items[k - 1];
      TORCH_CHECK_VALUE(false, "mfsdp_ext.", fn, ": ", what, "[", prev.idx, "] at [", prev.off, ", ",
                        prev.off + prev.len, ") and ", what, "[", it.idx, "] at [", it.off, ", ", it.off + it.len,
                        ") overlap in out");
    }
    if (it.off > cur) groups[first_group].push_back(Entry{it.off - cur, nullptr, out_ptr + cur * osz});
    groups[it.dtype].push_back(Entry{it.len, it.ptr, out_ptr + it.off * osz});
    cur = it.off + it.len;
  }
  if (cur < total) groups[first_group].push_back(Entry{total - cur, nullptr, out_ptr + cur * osz});

  const float fscale = static_cast<float>(scale);
  const bool use_scale = fscale != 1.0f;
  for (int g = 0; g < 3; ++g) {
    run_entries(groups[g], static_cast<DType>(g), od, fscale, use_scale, out, fn);
  }
}

// The checks pack and pack_pieces share: out is a flat float tensor on a supported device.
void check_pack_out(const at::Tensor& out, const char* fn) {
  TORCH_CHECK_VALUE(out.defined(), "mfsdp_ext.", fn, ": out is undefined");
  check_flat(out, fn, "out");
  check_device_supported(out, fn);
}

// A source tensor's data as a contiguous buffer (a copy kept alive in `keep` when it is not contiguous).
const void* contiguous_data(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  if (t.is_contiguous()) return t.data_ptr();
  keep.push_back(t.contiguous());
  return keep.back().data_ptr();
}

}  // namespace

void pack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, const at::Tensor& out,
          double scale) {
  const char* fn = "pack";
  TORCH_CHECK_VALUE(tensors.size() == offsets.size(), "mfsdp_ext.pack: got ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  check_pack_out(out, fn);
  const int64_t total = out.numel();
  const void* out_ptr = out.data_ptr();
  const int64_t out_bytes = total * out.element_size();
  std::vector<Item> items;
  items.reserve(tensors.size());
  std::vector<at::Tensor> keep;  // contiguous copies of non-contiguous inputs (alive until the launch)
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.pack: tensors[", i, "] is undefined");
    TORCH_CHECK_VALUE(t.device() == out.device(), "mfsdp_ext.pack: tensors[", i, "] is on ", t.device(), " but out is on ",
                out.device());
    const DType d = tensor_dtype(t, fn, "tensors", i);
    const int64_t len = t.numel();
    const int64_t off = offsets[i];
    TORCH_CHECK_VALUE(off >= 0 && off <= total - len, "mfsdp_ext.pack: tensors[", i, "] (", len, " elements) at offset ",
                off, " does not fit in out (", total, " elements)");
    if (len == 0 || out.is_meta()) continue;
    const void* ptr = contiguous_data(t, keep);
    TORCH_CHECK_VALUE(!bytes_overlap(ptr, len * t.element_size(), out_ptr, out_bytes), "mfsdp_ext.pack: tensors[", i,
                "] overlaps out in memory");
    items.push_back(Item{off, len, i, ptr, d});
  }
  pack_items(items, out, scale, fn, "tensors");
}

void pack_pieces(const std::vector<std::optional<at::Tensor>>& tensors, const at::Tensor& pieces, const at::Tensor& out,
                 double scale) {
  const char* fn = "pack_pieces";
  check_pack_out(out, fn);
  TORCH_CHECK_VALUE(pieces.device().is_cpu() && pieces.scalar_type() == at::kLong && pieces.dim() == 2 &&
                        pieces.size(1) == 4 && pieces.is_contiguous(),
              "mfsdp_ext.pack_pieces: pieces must be a contiguous CPU int64 tensor of shape (n, 4), got ",
              pieces.scalar_type(), " ", pieces.sizes(), " on ", pieces.device());
  const int64_t total = out.numel();
  const void* out_ptr = out.data_ptr();
  const int64_t out_bytes = total * out.element_size();
  const int64_t n = pieces.size(0);
  const int64_t* row = pieces.data_ptr<int64_t>();
  std::vector<const void*> data(tensors.size(), nullptr);  // each present tensor's contiguous data and dtype, once
  std::vector<DType> dtypes(tensors.size(), kF32);
  std::vector<at::Tensor> keep;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].has_value() || !tensors[i]->defined()) continue;
    const at::Tensor& t = *tensors[i];
    TORCH_CHECK_VALUE(t.device() == out.device(), "mfsdp_ext.pack_pieces: tensors[", i, "] is on ", t.device(),
                " but out is on ", out.device());
    dtypes[i] = tensor_dtype(t, fn, "tensors", i);
    if (t.numel() > 0 && !out.is_meta()) {
      data[i] = contiguous_data(t, keep);
      TORCH_CHECK_VALUE(!bytes_overlap(data[i], t.numel() * t.element_size(), out_ptr, out_bytes),
                  "mfsdp_ext.pack_pieces: tensors[", i, "] overlaps out in memory");
    }
  }
  std::vector<Item> items;
  items.reserve(n);
  for (int64_t k = 0; k < n; ++k, row += 4) {
    const int64_t t = row[0], first = row[1], len = row[2], off = row[3];
    TORCH_CHECK_VALUE(t >= 0 && t < static_cast<int64_t>(tensors.size()), "mfsdp_ext.pack_pieces: pieces[", k,
                "] names tensor ", t, " of ", tensors.size());
    TORCH_CHECK_VALUE(off >= 0 && len >= 0 && off <= total - len, "mfsdp_ext.pack_pieces: pieces[", k, "] (", len,
                " elements) at offset ", off, " does not fit in out (", total, " elements)");
    if (data[t] == nullptr) continue;  // a missing tensor (None): its range stays zero
    const at::Tensor& src = *tensors[t];
    TORCH_CHECK_VALUE(first >= 0 && first <= src.numel() - len, "mfsdp_ext.pack_pieces: pieces[", k, "] reads [",
                first, ", ", first + len, ") of tensors[", t, "], which has ", src.numel(), " elements");
    if (len == 0) continue;
    const char* src_ptr = static_cast<const char*>(data[t]) + first * src.element_size();
    items.push_back(Item{off, len, static_cast<size_t>(k), src_ptr, dtypes[t]});
  }
  pack_items(items, out, scale, fn, "pieces");
}

void unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets, const std::vector<at::Tensor>& outs) {
  const char* fn = "unpack";
  TORCH_CHECK_VALUE(outs.size() == offsets.size(), "mfsdp_ext.unpack: got ", outs.size(), " outputs but ", offsets.size(),
              " offsets");
  TORCH_CHECK_VALUE(flat.defined(), "mfsdp_ext.unpack: flat is undefined");
  check_flat(flat, fn, "flat");
  check_device_supported(flat, fn);
  const DType fd = float_dtype(flat, fn, "flat");
  const bool meta = flat.is_meta();
  const int64_t total = flat.numel();
  const int64_t fsz = flat.element_size();
  const char* flat_ptr = static_cast<const char*>(flat.data_ptr());

  std::array<std::vector<Entry>, 3> groups;
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& t = outs[i];
    TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.unpack: outs[", i, "] is undefined");
    TORCH_CHECK_VALUE(t.device() == flat.device(), "mfsdp_ext.unpack: outs[", i, "] is on ", t.device(),
                " but flat is on ", flat.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), "mfsdp_ext.unpack: outs[", i, "] must be contiguous (sizes ", t.sizes(),
                ", strides ", t.strides(), ")");
    const DType d = tensor_dtype(t, fn, "outs", i);
    const int64_t len = t.numel();
    const int64_t off = offsets[i];
    TORCH_CHECK_VALUE(off >= 0 && off <= total - len, "mfsdp_ext.unpack: outs[", i, "] (", len, " elements) at offset ",
                off, " reads past the end of flat (", total, " elements)");
    if (len == 0 || meta) continue;
    TORCH_CHECK_VALUE(!bytes_overlap(t.data_ptr(), len * t.element_size(), flat_ptr, total * fsz), "mfsdp_ext.unpack: outs[",
                i, "] overlaps flat in memory");
    groups[d].push_back(Entry{len, flat_ptr + off * fsz, t.data_ptr()});
  }
  for (int g = 0; g < 3; ++g) {
    run_entries(groups[g], fd, static_cast<DType>(g), 1.0f, false, flat, fn);
  }
}

}  // namespace mfsdp
