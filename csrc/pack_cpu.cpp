// CPU kernel of pack / unpack: runs a copy table (launch.h) as one pass over its concatenated "virtual" index
// space with at::parallel_for; each task finds its first entry by binary search. Same conversions as
// pack_cuda.cu.
#include <algorithm>

#include "cpu_kernel_utils.h"
#include "launch.h"

namespace mfsdp {
namespace cpu {

int launch(const CopyTableParams& p, void*) {
  const int64_t n = p.num_entries;
  const int64_t total = p.total;
  if (total <= 0 || n <= 0) return 0;
  const int64_t* vstart = p.host_table;
  const int64_t* srcs = p.host_table + n + 1;
  const int64_t* dsts = p.host_table + 2 * n + 1;
  with_float_tag(p.src_dtype, [&](auto in_tag) {
    with_float_tag(p.dst_dtype, [&](auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      using IR = typename In::raw;
      using OR = typename Out::raw;
      at::parallel_for(0, total, kGrain, [&](int64_t b0, int64_t b1) {
        int64_t i = std::upper_bound(vstart + 1, vstart + n + 1, b0) - (vstart + 1);
        int64_t q0 = b0;
        while (q0 < b1 && i < n) {
          const int64_t s = vstart[i], e = vstart[i + 1];
          if (e <= q0) {
            ++i;
            continue;
          }
          const int64_t q1 = std::min(e, b1);
          const int64_t off = q0 - s;
          OR* dst = reinterpret_cast<OR*>(dsts[i]) + off;
          const IR* src = reinterpret_cast<const IR*>(srcs[i]);
          if (src == nullptr) {
            zero_range<Out>(dst, q1 - q0);
          } else {
            copy_range<In, Out>(src + off, dst, q1 - q0, p.scale, p.use_scale);
          }
          q0 = q1;
        }
      });
    });
  });
  return 0;
}

}  // namespace cpu
}  // namespace mfsdp
