// CUDA kernel of pack / unpack: one launch copies (and casts, and scales) any number of tensors to or
// from a flat buffer, driven by a small table (see launch.h): in the kernel's parameters when it is small
// (copy_table_inline_kernel: no upload, capturable in a CUDA graph), else in device memory
// (copy_table_kernel). The CPU version is in pack_cpu.cpp.
#include <cuda_runtime.h>

#include "kernel_utils.cuh"
#include "launch.h"

namespace mfsdp {
namespace cuda {
namespace {

using namespace detail;

template <class In, class Out>
__device__ __forceinline__ void copy_table_body(const int64_t* __restrict__ table, int64_t n, int64_t total,
                                                int64_t chunk, int64_t nchunks, float scale, bool use_scale) {
  using IR = typename In::raw;
  using OR = typename Out::raw;
  const int64_t* vstart = table;
  const int64_t* srcs = table + n + 1;
  const int64_t* dsts = table + 2 * n + 1;
  int64_t hint = 0;  // entries before it end at or before this block's next chunk
  for_each_chunk(chunk, nchunks, total, [&](int64_t b0, int64_t b1) {
    int64_t i = hint + block_first_end_gt(vstart + hint + 1, 1, n - hint, b0);
    int64_t p = b0;
    while (p < b1 && i < n) {
      const int64_t s = vstart[i];
      const int64_t e = vstart[i + 1];
      if (e <= p) {
        ++i;
        continue;
      }
      const int64_t q = e < b1 ? e : b1;
      const int64_t off = p - s;
      OR* dst = reinterpret_cast<OR*>(dsts[i]) + off;
      const IR* src = reinterpret_cast<const IR*>(srcs[i]);
      if (src == nullptr) {
        ZeroOp<Out> op{dst};
        run_range(op, q - p);
      } else {
        CopyOp<In, Out> op{src + off, dst, scale, use_scale};
        run_range(op, q - p);
      }
      p = q;
    }
    hint = i < n ? i : n;
  });
}

template <class In, class Out>
__global__ void __launch_bounds__(kThreads)
    copy_table_kernel(const int64_t* __restrict__ table, int64_t n, int64_t total, int64_t chunk, int64_t nchunks,
                      float scale, bool use_scale) {
  copy_table_body<In, Out>(table, n, total, chunk, nchunks, scale, use_scale);
}

struct InlineTable {
  int64_t words[copy_table_words(kInlineTableEntries)];
};

// __grid_constant__: the table is read in place from the parameter space (no per-thread copy)
template <class In, class Out>
__global__ void __launch_bounds__(kThreads)
    copy_table_inline_kernel(const __grid_constant__ InlineTable table, int64_t n, int64_t total, int64_t chunk,
                             int64_t nchunks, float scale, bool use_scale) {
  copy_table_body<In, Out>(table.words, n, total, chunk, nchunks, scale, use_scale);
}

// table: device pointer (copy_table) or, with kInline, host words copied into the kernel's parameters
template <class In, class Out, bool kInline>
int launch_copy_table(const int64_t* table, int64_t n, int64_t total, float scale, bool use_scale,
                      cudaStream_t stream) {
  if constexpr (kInline) {
    InlineTable t;
    for (int64_t k = 0; k < copy_table_words(n); ++k) t.words[k] = table[k];
    auto kernel = copy_table_inline_kernel<In, Out>;
    const Grid g = make_grid(reinterpret_cast<const void*>(kernel), total);
    kernel<<<g.blocks, kThreads, 0, stream>>>(t, n, total, g.chunk, g.nchunks, scale, use_scale);
  } else {
    auto kernel = copy_table_kernel<In, Out>;
    const Grid g = make_grid(reinterpret_cast<const void*>(kernel), total);
    kernel<<<g.blocks, kThreads, 0, stream>>>(table, n, total, g.chunk, g.nchunks, scale, use_scale);
  }
  return last_error();
}

template <bool kInline>
int dispatch(const int64_t* table, const CopyTableParams& p, cudaStream_t stream) {
  return for_float(p.src_dtype, [&](auto in_tag) {
    return for_float(p.dst_dtype, [&](auto out_tag) {
      return launch_copy_table<decltype(in_tag), decltype(out_tag), kInline>(table, p.num_entries, p.total, p.scale,
                                                                            p.use_scale, stream);
    });
  });
}

}  // namespace

// Small tables go in the kernel's parameters (copied from p.host_table), larger ones are read from
// p.device_table.
int launch(const CopyTableParams& p, void* stream) {
  if (p.total <= 0 || p.num_entries <= 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.num_entries <= kInlineTableEntries) return dispatch<true>(p.host_table, p, s);
  if (p.device_table == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  return dispatch<false>(p.device_table, p, s);
}

}  // namespace cuda
}  // namespace mfsdp
