// Device building blocks shared by pack_cuda.cu and cast_cuda.cu (plain CUDA, no torch headers).
//
// Work split: a kernel covers one flat index space [0, total) cut into chunks of `chunk` elements (a multiple
// of 64). One wave of resident blocks; block b takes chunks b, b + gridDim, ... (so the blocks running at one
// time read one contiguous window of memory, as a grid-stride loop does). Where a chunk meets a segment table
// the block finds the chunk's first segment with a block-cooperative k-ary search (`block_first_end_gt`),
// starting from the segment it stopped at in its previous chunk, and walks forward.
// Inside one range (a piece of one segment, or a gap) the block's threads run `run_range`: scalar head until
// the destination is 16-byte aligned, then 16-byte vector stores and 16-byte vector loads for the body (a
// source that is not 16-byte aligned at the same element is read with aligned loads and funnel shifts, so
// every load stays a coalesced 16-byte load), scalar tail.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "float_formats.h"
#include "segment_walk.h"

namespace mfsdp {
namespace cuda {
namespace detail {

constexpr int kThreads = 256;
// chunk size bounds (elements), see make_grid
constexpr int64_t kMinChunk = 1024;
constexpr int64_t kMaxChunk = 16384;

// ---------------------------------------------------------------------------------------------
// 16-byte vector registers
// ---------------------------------------------------------------------------------------------
// N elements of raw type R kept as 32-bit words (element access by shifts, so everything stays in registers)
template <class R, int N>
struct VecRegs {
  static_assert((N * sizeof(R)) % 16 == 0, "vector must be a multiple of 16 bytes");
  static constexpr int kWords = int(N * sizeof(R) / 4);
  uint32_t w[kWords];
  __device__ __forceinline__ R get(int k) const {
    if constexpr (sizeof(R) == 4) {
      return static_cast<R>(w[k]);
    } else if constexpr (sizeof(R) == 2) {
      return static_cast<R>(w[k >> 1] >> ((k & 1) * 16));
    } else {
      return static_cast<R>(w[k >> 2] >> ((k & 3) * 8));
    }
  }
  // elements must be set in increasing k
  __device__ __forceinline__ void set(int k, R v) {
    const uint32_t x = static_cast<uint32_t>(v);
    if constexpr (sizeof(R) == 4) {
      w[k] = x;
    } else if constexpr (sizeof(R) == 2) {
      w[k >> 1] = (k & 1) ? (w[k >> 1] | (x << 16)) : x;
    } else {
      w[k >> 2] = (k & 3) ? (w[k >> 2] | (x << ((k & 3) * 8))) : x;
    }
  }
};

template <class R, int N>
__device__ __forceinline__ void vload(VecRegs<R, N>& r, const R* p) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int k = 0; k < VecRegs<R, N>::kWords / 4; ++k) {
    const uint4 t = q[k];
    r.w[4 * k] = t.x;
    r.w[4 * k + 1] = t.y;
    r.w[4 * k + 2] = t.z;
    r.w[4 * k + 3] = t.w;
  }
}

template <class R, int N>
__device__ __forceinline__ void vstore(R* p, const VecRegs<R, N>& r) {
  uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int k = 0; k < VecRegs<R, N>::kWords / 4; ++k) {
    q[k] = make_uint4(r.w[4 * k], r.w[4 * k + 1], r.w[4 * k + 2], r.w[4 * k + 3]);
  }
}

// N elements of R starting at p, which is NOT 16-byte aligned: aligned 16-byte loads of the window around
// them, then funnel shifts. WS = (p & 15) / 4 words, bs = 8 * (p & 3) bits (0 or 16 for 2-byte elements,
// 0/8/16/24 for bytes). The last load may read up to 15 bytes past the last element, never past the 16-byte
// block holding it (so never into another page).
template <int WS, class R, int N>
__device__ __forceinline__ void vload_shift(VecRegs<R, N>& r, const R* p, int bs) {
  constexpr int W = VecRegs<R, N>::kWords;
  constexpr int K = W / 4 + 1;
  const uint4* q = reinterpret_cast<const uint4*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t(15));
  uint32_t t[4 * K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint4 v = q[k];
    t[4 * k] = v.x;
    t[4 * k + 1] = v.y;
    t[4 * k + 2] = v.z;
    t[4 * k + 3] = v.w;
  }
#pragma unroll
  for (int i = 0; i < W; ++i) r.w[i] = __funnelshift_r(t[i + WS], t[i + WS + 1], bs);
}

// Elements before `dst` (element size dsize) is 16-byte aligned, or -1 if dst is not even element-aligned.
__device__ __forceinline__ int64_t vec_head(const void* dst, int dsize) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  const int64_t h = static_cast<int64_t>((16u - (a & 15u)) & 15u) / dsize;
  if ((a + h * dsize) & 15u) return -1;
  return h;
}

// Byte misalignment (0..15) of src at element h.
__device__ __forceinline__ int src_misalign(const void* src, int ssize, int64_t h) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(src) + h * ssize) & 15u);
}

// The vector body of run_range: vectors [0, nvec) starting at element `head`; MODE -1: aligned source,
// MODE 0..3: source misaligned by 4 * MODE + bs / 8 bytes.
template <int MODE, class Op>
__device__ __forceinline__ void run_body(Op& op, int64_t head, int64_t nvec, int bs) {
  constexpr int VEC = Op::VEC;
  constexpr int U = Op::U;
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int64_t step = static_cast<int64_t>(nt) * U;
  for (int64_t v0 = 0; v0 < nvec; v0 += step) {
    typename Op::Regs r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * nt + tid;
      if (v < nvec) {
        if constexpr (MODE < 0) {
          op.load(head + v * VEC, r[u]);
        } else {
          op.template load_shift<MODE>(head + v * VEC, r[u], bs);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * nt + tid;
      if (v < nvec) op.store(head + v * VEC, r[u]);
    }
  }
}

// Run `op` over elements [0, n) of one range with the whole block. Op provides:
//   VEC, U, Regs, head() (elements before its destination is 16-byte aligned), src_mis(h) (byte misalignment
//   of its source at element h; 0 if it has none), load(j, Regs&) / load_shift<WS>(j, Regs&, bs) and
//   store(j, Regs&) for VEC elements at j, one(j) for one element.
// U vectors per thread per iteration: all loads are issued before the stores.
template <class Op>
__device__ __forceinline__ void run_range(Op& op, int64_t n) {
  constexpr int VEC = Op::VEC;
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  int64_t head = op.head();
  if (head < 0) {
    for (int64_t j = tid; j < n; j += nt) op.one(j);
    return;
  }
  if (head > n) head = n;
  for (int64_t j = tid; j < head; j += nt) op.one(j);
  const int64_t nvec = (n - head) / VEC;
  if (nvec > 0) {
    const int mis = op.src_mis(head);
    const int bs = (mis & 3) * 8;
    switch (mis >> 2) {
      case 0:
        if (mis == 0) {
          run_body<-1>(op, head, nvec, 0);
        } else {
          run_body<0>(op, head, nvec, bs);
        }
        break;
      case 1: run_body<1>(op, head, nvec, bs); break;
      case 2: run_body<2>(op, head, nvec, bs); break;
      default: run_body<3>(op, head, nvec, bs); break;
    }
  }
  for (int64_t j = head + nvec * VEC + tid; j < n; j += nt) op.one(j);
}

// ---------------------------------------------------------------------------------------------
// Ops
// ---------------------------------------------------------------------------------------------
template <class In, class Out>
struct CopyOp {
  using IR = typename In::raw;
  using OR = typename Out::raw;
  static constexpr int kMin = sizeof(IR) < sizeof(OR) ? int(sizeof(IR)) : int(sizeof(OR));
  static constexpr int VEC = 16 / kMin;
  static constexpr int U = (VEC * sizeof(IR) >= 32 || VEC * sizeof(OR) >= 64) ? 1 : 2;
  static constexpr bool kSame = std::is_same<In, Out>::value;
  struct Regs {
    VecRegs<IR, VEC> v;
  };
  const IR* src;
  OR* dst;
  float scale;
  bool use_scale;

  __device__ __forceinline__ int64_t head() const { return vec_head(dst, sizeof(OR)); }
  __device__ __forceinline__ int src_mis(int64_t h) const { return src_misalign(src, sizeof(IR), h); }
  __device__ __forceinline__ OR conv(IR x) const {
    if constexpr (kSame) {
      if (!use_scale) return x;
    }
    float f = In::load(x);
    if (use_scale) f = mul_rn(f, scale);
    return Out::store(f);
  }
  __device__ __forceinline__ void load(int64_t j, Regs& r) const { vload(r.v, src + j); }
  template <int WS>
  __device__ __forceinline__ void load_shift(int64_t j, Regs& r, int bs) const {
    vload_shift<WS>(r.v, src + j, bs);
  }
  __device__ __forceinline__ void store(int64_t j, const Regs& r) const {
    if constexpr (kSame) {
      if (!use_scale) {
        vstore(dst + j, r.v);
        return;
      }
    }
    VecRegs<OR, VEC> o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) o.set(k, conv(r.v.get(k)));
    vstore(dst + j, o);
  }
  __device__ __forceinline__ void one(int64_t j) const { dst[j] = conv(src[j]); }
};

template <class Out>
struct ZeroOp {
  using OR = typename Out::raw;
  static constexpr int VEC = 16 / sizeof(OR);
  static constexpr int U = 1;
  struct Regs {};
  OR* dst;
  __device__ __forceinline__ int64_t head() const { return vec_head(dst, sizeof(OR)); }
  __device__ __forceinline__ int src_mis(int64_t) const { return 0; }
  __device__ __forceinline__ void load(int64_t, Regs&) const {}
  template <int WS>
  __device__ __forceinline__ void load_shift(int64_t, Regs&, int) const {}
  __device__ __forceinline__ void store(int64_t j, const Regs&) const {
    *reinterpret_cast<uint4*>(dst + j) = make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ void one(int64_t j) const { dst[j] = OR(0); }
};

// max |x| as fp32 bits (|x| >= 0 orders like its bit pattern; NaN bits are above inf, so NaN wins)
template <class In>
struct AmaxOp {
  using IR = typename In::raw;
  static constexpr int VEC = 16 / sizeof(IR);
  static constexpr int U = 2;
  struct Regs {
    VecRegs<IR, VEC> v;
  };
  const IR* src;
  uint32_t m;

  __device__ __forceinline__ int64_t head() const { return vec_head(src, sizeof(IR)); }
  __device__ __forceinline__ int src_mis(int64_t) const { return 0; }
  __device__ __forceinline__ void take(IR x) {
    const uint32_t a = f2u(In::load(x)) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  __device__ __forceinline__ void load(int64_t j, Regs& r) const { vload(r.v, src + j); }
  template <int WS>
  __device__ __forceinline__ void load_shift(int64_t, Regs&, int) const {}
  __device__ __forceinline__ void store(int64_t, const Regs& r) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) take(r.v.get(k));
  }
  __device__ __forceinline__ void one(int64_t j) { take(src[j]); }
};

// main = (accumulate ? main : 0) + scale * reduced, fp32 arithmetic, one rounding when accumulating
template <class Main, class Red>
struct GradAccOp {
  using MR = typename Main::raw;
  using RR = typename Red::raw;
  static constexpr int kMin = sizeof(MR) < sizeof(RR) ? int(sizeof(MR)) : int(sizeof(RR));
  static constexpr int VEC = 16 / kMin;
  static constexpr int U = (VEC * sizeof(RR) >= 32) ? 1 : 2;
  struct Regs {
    VecRegs<MR, VEC> m;
    VecRegs<RR, VEC> r;
  };
  MR* main;
  const RR* red;
  float scale;
  bool accumulate;

  __device__ __forceinline__ int64_t head() const { return vec_head(main, sizeof(MR)); }
  __device__ __forceinline__ int src_mis(int64_t h) const { return src_misalign(red, sizeof(RR), h); }
  __device__ __forceinline__ MR conv(MR m, RR r) const {
    const float x = Red::load(r);
    const float y = accumulate ? fma_rn(scale, x, Main::load(m)) : mul_rn(scale, x);
    return Main::store(y);
  }
  __device__ __forceinline__ void load(int64_t j, Regs& r) const {
    vload(r.r, red + j);
    if (accumulate) vload(r.m, main + j);
  }
  template <int WS>
  __device__ __forceinline__ void load_shift(int64_t j, Regs& r, int bs) const {
    vload_shift<WS>(r.r, red + j, bs);
    if (accumulate) vload(r.m, main + j);
  }
  __device__ __forceinline__ void store(int64_t j, const Regs& r) const {
    VecRegs<MR, VEC> o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) o.set(k, conv(accumulate ? r.m.get(k) : MR(0), r.r.get(k)));
    vstore(main + j, o);
  }
  __device__ __forceinline__ void one(int64_t j) const { main[j] = conv(accumulate ? main[j] : MR(0), red[j]); }
};

// ---------------------------------------------------------------------------------------------
// Block-level helpers (every thread of the block must call them, with the same arguments)
// ---------------------------------------------------------------------------------------------
// First i in [0, n) with ends[i * stride] > p, or n. ends[] must be non-decreasing (a bad table gives a
// wrong but in-range answer). One round per factor of blockDim (>= 2) in n: one round for n <= 256.
__device__ __forceinline__ int64_t block_first_end_gt(const int64_t* ends, int64_t stride, int64_t n, int64_t p) {
  const int64_t nt = blockDim.x;
  const int64_t tid = threadIdx.x;
  int64_t lo = 0, len = n;
  while (len > nt) {
    const int64_t s = (len + nt - 1) / nt;
    const int64_t k = tid * s + s - 1;
    const int pred = (k < len) && (ends[(lo + k) * stride] <= p);
    const int64_t c = __syncthreads_count(pred);
    lo += c * s;
    len = (len - c * s) < s ? (len - c * s) : s;
  }
  const int pred = (tid < len) && (ends[(lo + tid) * stride] <= p);
  return lo + __syncthreads_count(pred);
}

// Max over the block (result valid in thread 0).
__device__ __forceinline__ uint32_t block_max_u32(uint32_t v) {
  __shared__ uint32_t warp_max[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = w > v ? w : v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_max may still be read by a previous call
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int((blockDim.x + 31) / 32) ? warp_max[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const uint32_t w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
      v = w > v ? w : v;
    }
  }
  return v;
}

// Ask L2 for the first bytes of a chunk's source before the block looks up its segments: the lookups are
// dependent global loads (table row, then the segment's amax or scale), and this way they overlap the
// chunk's first DRAM fetches instead of preceding them. Capped at 8 KiB per block so that a full wave of
// blocks stays far below the L2 size.
__device__ __forceinline__ void prefetch_chunk_head(const void* p, int64_t bytes) {
  constexpr int64_t kLine = 128, kMaxBytes = 8192;
  const int64_t n = bytes < kMaxBytes ? bytes : kMaxBytes;
  const char* c = static_cast<const char*>(p);
  for (int64_t off = static_cast<int64_t>(threadIdx.x) * kLine; off < n; off += static_cast<int64_t>(blockDim.x) * kLine) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
  }
}

// Walk the chunk [b0, b1) over a segment table seg (segment_walk.h). `hint`: no segment before it ends after
// b0 (0 at first; updated for the block's next chunk, which starts after b1).
template <class OnSeg, class OnGap>
__device__ __forceinline__ void walk_segments(const int64_t* seg, int64_t nseg, int64_t& hint, int64_t b0,
                                              int64_t b1, OnSeg&& on_seg, OnGap&& on_gap) {
  const int64_t i = hint + block_first_end_gt(seg + 2 * hint + 1, 2, nseg - hint, b0);
  hint = walk_segments_from(seg, nseg, i, b0, b1, on_seg, on_gap);
}

// ---------------------------------------------------------------------------------------------
// Launch configuration
// ---------------------------------------------------------------------------------------------
inline int num_sms() {
  static int cache[128] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 128) return 132;
  if (cache[dev] == 0) {
    int v = 0;
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    cache[dev] = v > 0 ? v : 132;
  }
  return cache[dev];
}

// resident blocks per SM of a kernel at kThreads threads (cached per kernel)
inline int blocks_per_sm(const void* kernel) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(kernel);
  if (it != cache.end()) return it->second;
  int v = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, kThreads, 0) != cudaSuccess || v < 1) {
    (void)cudaGetLastError();
    v = 1;
  }
  cache.emplace(kernel, v);
  return v;
}

struct Grid {
  int blocks;
  int64_t chunk;    // elements per chunk, a multiple of 64
  int64_t nchunks;  // chunks in [0, total)
};

// One wave of resident blocks striding over chunks: chunks of 16K elements, smaller (down to 1K) when the
// buffer is too small to give every resident block one.
inline Grid make_grid(const void* kernel, int64_t total) {
  const int64_t max_blocks = static_cast<int64_t>(num_sms()) * blocks_per_sm(kernel);
  int64_t chunk = (total + max_blocks - 1) / max_blocks;
  chunk = chunk < kMinChunk ? kMinChunk : (chunk > kMaxChunk ? kMaxChunk : chunk);
  chunk = (chunk + 63) / 64 * 64;
  const int64_t nchunks = total > 0 ? (total + chunk - 1) / chunk : 0;
  int64_t blocks = nchunks < max_blocks ? nchunks : max_blocks;
  if (blocks < 1) blocks = 1;
  return Grid{static_cast<int>(blocks), chunk, nchunks};
}

// body(b0, b1) for each chunk [b0, b1) of [0, total) that this block takes (see make_grid)
template <class Body>
__device__ __forceinline__ void for_each_chunk(int64_t chunk, int64_t nchunks, int64_t total, Body&& body) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t b0 = c * chunk;
    body(b0, (b0 + chunk < total) ? b0 + chunk : total);
  }
}

// The chunks of this block over a segment table: each chunk's source head is asked for first (see
// prefetch_chunk_head), then the chunk is walked (walk_segments).
template <class R, class OnSeg, class OnGap>
__device__ __forceinline__ void for_each_chunk_of_segments(const R* src, int64_t chunk, int64_t nchunks,
                                                           int64_t total, const int64_t* seg, int64_t nseg,
                                                           OnSeg&& on_seg, OnGap&& on_gap) {
  int64_t hint = 0;
  for_each_chunk(chunk, nchunks, total, [&](int64_t b0, int64_t b1) {
    prefetch_chunk_head(src + b0, (b1 - b0) * static_cast<int64_t>(sizeof(R)));
    walk_segments(seg, nseg, hint, b0, b1, on_seg, on_gap);
  });
}

inline int last_error() { return static_cast<int>(cudaGetLastError()); }

// f(tag) for a float / an fp8 dtype code (float_formats.h's dispatchers); cudaErrorInvalidValue for any other code
template <class F>
int for_float(DType d, F&& f) {
  return is_float_dtype(d) ? with_float_tag(d, f) : static_cast<int>(cudaErrorInvalidValue);
}
template <class F>
int for_fp8(DType d, F&& f) {
  return is_fp8_dtype(d) ? with_fp8_tag(d, f) : static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace detail
}  // namespace cuda
}  // namespace mfsdp
