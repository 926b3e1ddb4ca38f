// CUDA kernels of the FP8 activation / gradient quantizer (one tensor, per-tensor current scaling) and of the
// FP8 transpose. Semantics: launch.h and mfsdp_ext/_native/__init__.py (fp8_quantize, fp8_transpose); the CPU versions
// are in quantize_cpu.cpp, the entry points in quantize.cpp.
//
// The scale needs the amax of the whole tensor before the first element can be cast. Two ways:
//   two-pass: K1 writes one amax per block (no atomics, no memset); K2 reduces those values in every block,
//     then casts, walking the tensor from the end backwards so that it first re-reads what K1 read last,
//     which is still in L2. K2 is a programmatic dependent launch (sm_90): its launch overlaps K1's tail.
//   fused: one launch. Blocks take 64 x 128 tiles by ticket (an atomic counter), compute their amax, and keep
//     their first tile in registers; when every tile's amax is in, each block casts its held tile, then the
//     remaining tiles are taken by ticket again (last first, for L2) and re-read. A block only waits for
//     tiles other blocks have already taken, so no block has to be resident at the same time as another (no
//     grid barrier: SMs held by concurrent NCCL kernels delay nothing but themselves). Its counters live in a
//     per-(device, stream) workspace zeroed once; the last block out zeroes them again. Not under graph
//     capture (the workspace would be shared by the graph and the stream): quantize.cpp asks for two-pass there.
// Tiles are staged in shared memory (XOR-swizzled, conflict-free) when the transpose is written; the FP8
// transpose kernel is the same tile walk on FP8 input.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "fp8_scaling.h"
#include "kernel_utils.cuh"
#include "launch.h"

namespace mfsdp {
namespace cuda {
namespace {

using namespace detail;

// Programmatic dependent launch (sm_90+): the primary lets its dependents be scheduled, the dependent waits
// until the primary has finished and its writes are visible. Without a programmatic launch both are no-ops.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Max of partial[0, n) over the block -> the scale (same in every block). Block 0 writes scale_inv and amax.
// partial is 16-byte aligned (a fresh allocation): 16-byte loads, so a block reads its ~1000 values in about
// one L2 round trip before it can start.
template <class F8>
__device__ __forceinline__ float scale_from_partials(const uint32_t* __restrict__ partial, int64_t n, float eps,
                                                     float* __restrict__ scale_inv, float* __restrict__ amax_out) {
  __shared__ float s_scale;
  uint32_t m = 0;
  const uint4* p4 = reinterpret_cast<const uint4*>(partial);
  for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x) {
    const uint4 v = p4[i];
    const uint32_t a = v.x > v.y ? v.x : v.y, b = v.z > v.w ? v.z : v.w;
    m = a > b ? (a > m ? a : m) : (b > m ? b : m);
  }
  for (int64_t i = n / 4 * 4 + threadIdx.x; i < n; i += blockDim.x) m = partial[i] > m ? partial[i] : m;
  m = block_max_u32(m);
  if (threadIdx.x == 0) {
    const float amax = u2f(m);
    const float scale = fp8_scale(amax, F8::max_value, eps);
    s_scale = scale;
    if (blockIdx.x == 0) {
      scale_inv[0] = fp8_scale_inv(scale);
      if (amax_out != nullptr) amax_out[0] = amax;
    }
  }
  __syncthreads();
  return s_scale;
}

// ---------------------------------------------------------------------------------------------
// two-pass: K1 per-block amax, K2 cast
// ---------------------------------------------------------------------------------------------
template <class In>
__global__ void __launch_bounds__(kThreads)
    quant_amax_kernel(const typename In::raw* __restrict__ src, int64_t total, int64_t chunk, int64_t nchunks,
                      uint32_t* __restrict__ partial) {
  pdl_launch_dependents();
  uint32_t m = 0;
  for_each_chunk(chunk, nchunks, total, [&](int64_t b0, int64_t b1) {
    AmaxOp<In> op{src + b0, 0u};
    run_range(op, b1 - b0);
    m = op.m > m ? op.m : m;
  });
  m = block_max_u32(m);
  if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

template <class In, class F8>
__global__ void __launch_bounds__(kThreads)
    quant_cast_kernel(const typename In::raw* __restrict__ src, int64_t total, int64_t chunk, int64_t nchunks,
                      const uint32_t* __restrict__ partial, int64_t npartial, float eps,
                      typename F8::raw* __restrict__ dst, float* __restrict__ scale_inv, float* __restrict__ amax_out) {
  pdl_wait();
  const float scale = scale_from_partials<F8>(partial, npartial, eps, scale_inv, amax_out);
  // last chunks first: they are what K1 read last
  for (int64_t c = nchunks - 1 - blockIdx.x; c >= 0; c -= gridDim.x) {
    const int64_t b0 = c * chunk;
    const int64_t b1 = (b0 + chunk < total) ? b0 + chunk : total;
    CopyOp<In, F8> op{src + b0, dst + b0, scale, true};
    run_range(op, b1 - b0);
  }
}

// ---------------------------------------------------------------------------------------------
// 64 x 128 byte tiles in shared memory, for the transposing cast and the FP8 transpose
// ---------------------------------------------------------------------------------------------
constexpr int kTileR = 64;   // rows of the source per tile
constexpr int kTileC = 128;  // columns (bytes of FP8 output) per tile

// Word w of tile row r lives at word r * 32 + (w ^ 4 * ((r / 8) % 8)): the transposed read (8 rows x 4 words
// per warp, rows 8 apart) then hits 32 different banks, and 8- or 16-byte row writes stay contiguous.
__device__ __forceinline__ int tile_word(int r, int w) { return r * (kTileC / 4) + (w ^ (((r >> 3) & 7) << 2)); }
__device__ __forceinline__ int tile_byte(int r, int c) { return 4 * tile_word(r, c >> 2) + (c & 3); }

// Write the tile's transpose: dst_t[(c0 + c) * rows + r0 + r] = tile(r, c). full: the whole tile is inside
// the matrix and rows % 8 == 0 with dst_t 8-byte aligned (8-byte stores); otherwise byte by byte.
__device__ __forceinline__ void store_tile_transposed(const uint8_t* __restrict__ tile, uint8_t* __restrict__ dst_t,
                                                      int64_t rows, int64_t cols, int64_t r0, int64_t c0, bool full) {
  if (full) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(tile);
    const int q = threadIdx.x & 7;   // rows 8q .. 8q + 7
    const int c4 = threadIdx.x >> 3; // columns 4 c4 .. 4 c4 + 3
    uint32_t a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = w[tile_word(8 * q + i, c4)];
    // two 4x4 byte transposes: out[k] holds column 4 c4 + k of rows 8q..8q+3 (lo) and 8q+4..8q+7 (hi)
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t* b = a + 4 * h;
      const uint32_t t0 = __byte_perm(b[0], b[1], 0x5140), t1 = __byte_perm(b[0], b[1], 0x7362);
      const uint32_t t2 = __byte_perm(b[2], b[3], 0x5140), t3 = __byte_perm(b[2], b[3], 0x7362);
      uint32_t* o = h ? hi : lo;
      o[0] = __byte_perm(t0, t2, 0x5410);
      o[1] = __byte_perm(t0, t2, 0x7632);
      o[2] = __byte_perm(t1, t3, 0x5410);
      o[3] = __byte_perm(t1, t3, 0x7632);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      *reinterpret_cast<uint2*>(dst_t + (c0 + 4 * c4 + k) * rows + r0 + 8 * q) = make_uint2(lo[k], hi[k]);
    }
    return;
  }
  for (int i = threadIdx.x; i < kTileR * kTileC; i += blockDim.x) {
    const int c = i / kTileR, r = i % kTileR;  // r fastest: consecutive output bytes
    if (r0 + r < rows && c0 + c < cols) dst_t[(c0 + c) * rows + r0 + r] = tile[tile_byte(r, c)];
  }
}

struct TileGrid {
  int64_t tiles_c, ntiles;
  __device__ __forceinline__ TileGrid(int64_t rows, int64_t cols)
      : tiles_c((cols + kTileC - 1) / kTileC), ntiles(((rows + kTileR - 1) / kTileR) * tiles_c) {}
  __device__ __forceinline__ int64_t r0(int64_t t) const { return (t / tiles_c) * kTileR; }
  __device__ __forceinline__ int64_t c0(int64_t t) const { return (t % tiles_c) * kTileC; }
};

// One 64 x 128 tile of the source (rows, cols) with the whole block. The vector path ("full" tiles: inside the
// matrix, cols * sizeof(In) % 16 == 0, src 16-byte and dst 8-byte aligned) moves 16-byte source vectors,
// kLoads per thread; otherwise element by element.
template <class In, class F8>
struct TileIO {
  using IR = typename In::raw;
  using OR = typename F8::raw;
  static constexpr int VEC = 16 / sizeof(IR);               // source elements per 16-byte load
  static constexpr int kVecPerRow = kTileC / VEC;
  static constexpr int kLoads = kTileR * kVecPerRow / kThreads;
  using Regs = VecRegs<IR, VEC>;

  static __device__ __forceinline__ void load(Regs (&v)[kLoads], const IR* __restrict__ src, int64_t cols,
                                              int64_t r0, int64_t c0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int e = i * kThreads + threadIdx.x, r = e / kVecPerRow, j = e % kVecPerRow;
      vload(v[i], src + (r0 + r) * cols + c0 + j * VEC);
    }
  }

  static __device__ __forceinline__ uint32_t amax(const Regs (&v)[kLoads], uint32_t m) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const uint32_t a = f2u(In::load(v[i].get(k))) & 0x7FFFFFFFu;
        m = a > m ? a : m;
      }
    }
    return m;
  }

  static __device__ __forceinline__ uint32_t amax_scalar(const IR* __restrict__ src, int64_t rows, int64_t cols,
                                                         int64_t r0, int64_t c0, uint32_t m) {
    for (int i = threadIdx.x; i < kTileR * kTileC; i += blockDim.x) {
      const int r = i / kTileC, c = i % kTileC;
      if (r0 + r < rows && c0 + c < cols) {
        const uint32_t a = f2u(In::load(src[(r0 + r) * cols + c0 + c])) & 0x7FFFFFFFu;
        m = a > m ? a : m;
      }
    }
    return m;
  }

  // cast and store row-major; stage the FP8 bytes in `tile` when it is not null (for the transpose)
  static __device__ __forceinline__ void store(const Regs (&v)[kLoads], float scale, OR* __restrict__ dst,
                                               uint8_t* tile, int64_t cols, int64_t r0, int64_t c0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int e = i * kThreads + threadIdx.x, r = e / kVecPerRow, j = e % kVecPerRow;
      uint32_t w[VEC / 4];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const uint32_t b = F8::store(mul_rn(In::load(v[i].get(k)), scale));
        w[k >> 2] = (k & 3) ? (w[k >> 2] | (b << (8 * (k & 3)))) : b;
      }
      OR* out = dst + (r0 + r) * cols + c0 + j * VEC;
      uint32_t* sw = reinterpret_cast<uint32_t*>(tile);
      if constexpr (VEC == 8) {
        *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
        if (tile != nullptr) *reinterpret_cast<uint2*>(sw + tile_word(r, 2 * j)) = make_uint2(w[0], w[1]);
      } else {
        *reinterpret_cast<uint32_t*>(out) = w[0];
        if (tile != nullptr) sw[tile_word(r, j)] = w[0];
      }
    }
  }

  static __device__ __forceinline__ void store_scalar(const IR* __restrict__ src, float scale, OR* __restrict__ dst,
                                                      uint8_t* tile, int64_t rows, int64_t cols, int64_t r0,
                                                      int64_t c0) {
    for (int i = threadIdx.x; i < kTileR * kTileC; i += blockDim.x) {
      const int r = i / kTileC, c = i % kTileC;
      if (r0 + r < rows && c0 + c < cols) {
        const OR b = F8::store(mul_rn(In::load(src[(r0 + r) * cols + c0 + c]), scale));
        dst[(r0 + r) * cols + c0 + c] = b;
        if (tile != nullptr) tile[tile_byte(r, c)] = b;
      }
    }
  }

  // the whole cast of tile (r0, c0): re-read, cast, store, and the transposed store when dst_t is given.
  // tvec: the transposed store may use 8-byte stores (rows % 8 == 0, dst_t 8-byte aligned).
  static __device__ __forceinline__ void cast(const IR* __restrict__ src, float scale, OR* __restrict__ dst,
                                              OR* __restrict__ dst_t, uint8_t* tile, int64_t rows, int64_t cols,
                                              int64_t r0, int64_t c0, bool full, bool tvec) {
    uint8_t* stage = dst_t != nullptr ? tile : nullptr;
    if (full) {
      Regs v[kLoads];
      load(v, src, cols, r0, c0);
      store(v, scale, dst, stage, cols, r0, c0);
    } else {
      store_scalar(src, scale, dst, stage, rows, cols, r0, c0);
    }
    finish_transposed(tile, dst_t, rows, cols, r0, c0, full && tvec);
  }

  static __device__ __forceinline__ void finish_transposed(const uint8_t* tile, OR* __restrict__ dst_t, int64_t rows,
                                                           int64_t cols, int64_t r0, int64_t c0, bool vec_t) {
    if (dst_t == nullptr) return;
    __syncthreads();
    store_tile_transposed(tile, dst_t, rows, cols, r0, c0, vec_t);
    __syncthreads();  // the tile is rewritten next
  }
};

// ---------------------------------------------------------------------------------------------
// two-pass, K2 with the transposed output: dst (rows, cols) and dst_t (cols, rows)
// vec: full tiles take the vector path; tvec: and the transposed 8-byte stores (rows % 8 == 0)
// ---------------------------------------------------------------------------------------------
template <class In, class F8>
__global__ void __launch_bounds__(kThreads, sizeof(typename In::raw) == 4 ? 3 : 4)  // no spills, 3-4 blocks/SM
    quant_cast_t_kernel(const typename In::raw* __restrict__ src, int64_t rows, int64_t cols,
                        const uint32_t* __restrict__ partial, int64_t npartial, float eps,
                        typename F8::raw* __restrict__ dst, typename F8::raw* __restrict__ dst_t,
                        float* __restrict__ scale_inv, float* __restrict__ amax_out, bool vec, bool tvec) {
  using T = TileIO<In, F8>;
  __shared__ __align__(16) uint8_t tile[kTileR * kTileC];
  pdl_wait();
  const float scale = scale_from_partials<F8>(partial, npartial, eps, scale_inv, amax_out);
  const TileGrid tg(rows, cols);
  for (int64_t t = tg.ntiles - 1 - blockIdx.x; t >= 0; t -= gridDim.x) {  // last tiles first (in L2)
    const int64_t r0 = tg.r0(t), c0 = tg.c0(t);
    const bool full = vec && r0 + kTileR <= rows && c0 + kTileC <= cols;
    T::cast(src, scale, dst, dst_t, tile, rows, cols, r0, c0, full, tvec);
  }
}

// ---------------------------------------------------------------------------------------------
// fused: one launch, tiles by ticket, each block's first tile held in registers (see the top of the file)
// ---------------------------------------------------------------------------------------------
// workspace (uint32 words, zero between launches): [0, 2) phase-1 tickets, [2, 4) tiles whose amax is in,
// [4, 6) phase-2 tickets, [6, 8) blocks done (64-bit counters), [8] amax bits, [16, 16 + grid) held flags
constexpr int kWsHeld = 16;
constexpr int64_t kWsWords = kWsHeld + 32 * 1024;  // grid <= 32 blocks per SM x up to 1024 SMs

__device__ __forceinline__ unsigned long long* ws_counter(uint32_t* ws, int i) {
  return reinterpret_cast<unsigned long long*>(ws) + i;
}

// Tickets from an atomic counter, one ahead: thread 0 asks for the next ticket when the block starts on the
// current one, so the atomic's round trip overlaps the tile's loads. take() hands the asked-for ticket to every
// thread and asks for the one after it.
struct Tickets {
  unsigned long long* ctr;
  unsigned long long next;  // thread 0's pending ticket
  __device__ __forceinline__ explicit Tickets(unsigned long long* c) : ctr(c), next(0ull) {
    if (threadIdx.x == 0) next = atomicAdd(ctr, 1ull);
  }
  __device__ __forceinline__ int64_t take() {
    __shared__ int64_t s;
    __syncthreads();  // everyone has read the previous ticket
    if (threadIdx.x == 0) {
      s = static_cast<int64_t>(next);
      next = atomicAdd(ctr, 1ull);
    }
    __syncthreads();
    return s;
  }
};

template <class In, class F8>
__global__ void __launch_bounds__(kThreads)
    quant_fused_kernel(const typename In::raw* __restrict__ src, int64_t rows, int64_t cols, bool vec, bool tvec,
                       float eps, typename F8::raw* __restrict__ dst, typename F8::raw* __restrict__ dst_t,
                       float* __restrict__ scale_inv, float* __restrict__ amax_out, uint32_t* ws) {
  using T = TileIO<In, F8>;  // ws: counters other blocks change, never __restrict__
  __shared__ __align__(16) uint8_t tile[kTileR * kTileC];
  __shared__ uint32_t s_word;
  const TileGrid tg(rows, cols);
  const int64_t ntiles = tg.ntiles;
  volatile uint32_t* held_flag = ws + kWsHeld;

  // phase 1: amax of the tiles this block takes; the first one (if it is a full tile) stays in registers
  typename T::Regs held[T::kLoads];
  int64_t held_t = -1, taken = 0;
  uint32_t m = 0;
  Tickets tickets1(ws_counter(ws, 0));
  for (;;) {
    const int64_t t = tickets1.take();
    if (t >= ntiles) break;
    const int64_t r0 = tg.r0(t), c0 = tg.c0(t);
    const bool full = vec && r0 + kTileR <= rows && c0 + kTileC <= cols;
    if (full && taken == 0 && t < gridDim.x) {
      T::load(held, src, cols, r0, c0);
      m = T::amax(held, m);
      held_t = t;
      if (threadIdx.x == 0) held_flag[t] = 1u;
    } else if (full) {
      typename T::Regs v[T::kLoads];
      T::load(v, src, cols, r0, c0);
      m = T::amax(v, m);
    } else {
      m = T::amax_scalar(src, rows, cols, r0, c0, m);
    }
    ++taken;
  }
  m = block_max_u32(m);
  if (threadIdx.x == 0) {
    if (m != 0u) atomicMax(ws + 8, m);
    __threadfence();  // the amax and the held flag before the count
    atomicAdd(ws_counter(ws, 1), static_cast<unsigned long long>(taken));
    // wait for the tiles other blocks have taken (they are running: taking one means running); plain L2 reads,
    // not atomics, so that the spinning does not queue behind the ticket atomics
    const volatile unsigned long long* done = ws_counter(ws, 1);
    while (*done < static_cast<unsigned long long>(ntiles)) __nanosleep(64);
    __threadfence();
    s_word = *static_cast<volatile uint32_t*>(ws + 8);
  }
  __syncthreads();
  const float amax = u2f(s_word);
  const float scale = fp8_scale(amax, F8::max_value, eps);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    scale_inv[0] = fp8_scale_inv(scale);
    if (amax_out != nullptr) amax_out[0] = amax;
  }

  // phase 2: the held tile, then the others by ticket, last first
  if (held_t >= 0) {
    const int64_t r0 = tg.r0(held_t), c0 = tg.c0(held_t);
    T::store(held, scale, dst, dst_t != nullptr ? tile : nullptr, cols, r0, c0);
    T::finish_transposed(tile, dst_t, rows, cols, r0, c0, tvec);
  }
  Tickets tickets2(ws_counter(ws, 2));
  for (;;) {
    const int64_t u = tickets2.take();
    if (u >= ntiles) break;
    const int64_t t = ntiles - 1 - u;
    if (t < gridDim.x) {  // held by some block? (its flag is final: set before the count we waited for)
      __syncthreads();
      if (threadIdx.x == 0) {
        s_word = held_flag[t];
        held_flag[t] = 0u;  // each tile is visited once here: the workspace is clean again at the end
      }
      __syncthreads();
      if (s_word != 0u) continue;
    }
    const int64_t r0 = tg.r0(t), c0 = tg.c0(t);
    const bool full = vec && r0 + kTileR <= rows && c0 + kTileC <= cols;
    T::cast(src, scale, dst, dst_t, tile, rows, cols, r0, c0, full, tvec);
  }

  // the last block out zeroes the counters (everyone else is past its last ticket and its wait)
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(ws_counter(ws, 3), 1ull) == static_cast<unsigned long long>(gridDim.x) - 1ull) {
      *ws_counter(ws, 0) = 0ull;
      *ws_counter(ws, 1) = 0ull;
      *ws_counter(ws, 2) = 0ull;
      *ws_counter(ws, 3) = 0ull;
      ws[8] = 0u;
      __threadfence();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// FP8 transpose: dst (cols, rows) = src (rows, cols), bytes
// vec: cols % 16 == 0, rows % 8 == 0, src 16-byte and dst 8-byte aligned
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads)
    transpose_u8_kernel(const uint8_t* __restrict__ src, int64_t rows, int64_t cols, uint8_t* __restrict__ dst,
                        bool vec) {
  constexpr int kVecPerRow = kTileC / 16;
  constexpr int kLoads = kTileR * kVecPerRow / kThreads;
  __shared__ __align__(16) uint8_t tile[kTileR * kTileC];
  const TileGrid tg(rows, cols);
  for (int64_t t = blockIdx.x; t < tg.ntiles; t += gridDim.x) {
    const int64_t r0 = (t / tg.tiles_c) * kTileR, c0 = (t % tg.tiles_c) * kTileC;
    const bool full = vec && r0 + kTileR <= rows && c0 + kTileC <= cols;
    if (full) {
      uint4 v[kLoads];
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int e = i * kThreads + threadIdx.x, r = e / kVecPerRow, j = e % kVecPerRow;
        v[i] = *reinterpret_cast<const uint4*>(src + (r0 + r) * cols + c0 + 16 * j);
      }
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int e = i * kThreads + threadIdx.x, r = e / kVecPerRow, j = e % kVecPerRow;
        *reinterpret_cast<uint4*>(reinterpret_cast<uint32_t*>(tile) + tile_word(r, 4 * j)) = v[i];
      }
    } else {
      for (int i = threadIdx.x; i < kTileR * kTileC; i += blockDim.x) {
        const int r = i / kTileC, c = i % kTileC;
        if (r0 + r < rows && c0 + c < cols) tile[tile_byte(r, c)] = src[(r0 + r) * cols + c0 + c];
      }
    }
    __syncthreads();
    store_tile_transposed(tile, dst, rows, cols, r0, c0, full);
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------------------------
bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

// sm_90+: programmatic dependent launch is available (cached per device)
bool device_has_pdl() {
  static int cache[128] = {0};  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 128) return false;
  if (cache[dev] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cache[dev] = major >= 9 ? 2 : 1;
  }
  return cache[dev] == 2;
}

// one wave of resident blocks over ntiles tiles (at least one block)
int tile_blocks(const void* kernel, int64_t ntiles) {
  const int64_t max_blocks = static_cast<int64_t>(num_sms()) * blocks_per_sm(kernel);
  const int64_t b = ntiles < max_blocks ? ntiles : max_blocks;
  return static_cast<int>(b < 1 ? 1 : b);
}

template <class Kernel, class... Args>
int launch_dependent(Kernel kernel, int blocks, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = device_has_pdl() ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// A workspace of `words` uint32 for the current device and `stream` (one per `kind`): allocated and zeroed (on the
// stream) on first use, kept for the life of the process.
uint32_t* stream_workspace(int kind, int64_t words, cudaStream_t stream, int* err) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, cudaStream_t>, uint32_t*> spaces;
  int dev = 0;
  *err = static_cast<int>(cudaGetDevice(&dev));
  if (*err != 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  auto it = spaces.find({kind, dev, stream});
  if (it != spaces.end()) return it->second;
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(words) * sizeof(uint32_t);
  *err = static_cast<int>(cudaMalloc(&p, bytes));
  if (*err == 0) *err = static_cast<int>(cudaMemsetAsync(p, 0, bytes, stream));
  if (*err != 0) return nullptr;
  spaces.emplace(std::make_tuple(kind, dev, stream), static_cast<uint32_t*>(p));
  return static_cast<uint32_t*>(p);
}

// The fused kernel's workspace: left zeroed by every launch.
uint32_t* fused_workspace(cudaStream_t stream, int* err) { return stream_workspace(0, kWsWords, stream, err); }

template <class In, class F8>
int launch_fused(const void* src, int64_t numel, int64_t cols, void* dst, void* dst_t, float* scale_inv,
                 float* amax, float eps, cudaStream_t stream) {
  using IR = typename In::raw;
  int err = 0;
  uint32_t* ws = fused_workspace(stream, &err);
  if (ws == nullptr) return err;
  int64_t rows = cols > 0 ? numel / cols : 0;
  if (dst_t == nullptr && numel % kTileC == 0) {  // no transpose: any 2-D view will do; this one has full tiles
    cols = kTileC;
    rows = numel / kTileC;
  }
  constexpr int VEC = 16 / sizeof(IR);
  const bool vec = (cols * static_cast<int64_t>(sizeof(IR))) % 16 == 0 && aligned(src, 16) && aligned(dst, VEC);
  const bool tvec = rows % 8 == 0 && aligned(dst_t, 8);
  auto kernel = quant_fused_kernel<In, F8>;
  const int64_t ntiles = ((rows + kTileR - 1) / kTileR) * ((cols + kTileC - 1) / kTileC);
  const int blocks = tile_blocks(reinterpret_cast<const void*>(kernel), ntiles);
  if (blocks > kWsWords - kWsHeld) return static_cast<int>(cudaErrorInvalidConfiguration);
  kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const IR*>(src), rows, cols, vec, tvec, eps,
                                          static_cast<typename F8::raw*>(dst), static_cast<typename F8::raw*>(dst_t),
                                          scale_inv, amax, ws);
  return last_error();
}

template <class In, class F8>
int launch_two_pass(const void* src, int64_t numel, int64_t cols, void* dst, void* dst_t, float* scale_inv,
                    float* amax, float eps, uint32_t* partial, cudaStream_t stream) {
  using IR = typename In::raw;
  auto* s = static_cast<const IR*>(src);
  auto* d = static_cast<typename F8::raw*>(dst);
  auto k1 = quant_amax_kernel<In>;
  const Grid g1 = make_grid(reinterpret_cast<const void*>(k1), numel);
  if (numel > 0) {
    k1<<<g1.blocks, kThreads, 0, stream>>>(s, numel, g1.chunk, g1.nchunks, partial);
    const int err = last_error();
    if (err != 0) return err;
  }
  const int64_t npartial = numel > 0 ? g1.blocks : 0;  // none: amax 0, scale 1
  if (dst_t == nullptr) {
    auto k2 = quant_cast_kernel<In, F8>;
    const Grid g2 = make_grid(reinterpret_cast<const void*>(k2), numel);
    return launch_dependent(k2, g2.blocks, stream, s, numel, g2.chunk, g2.nchunks,
                            static_cast<const uint32_t*>(partial), npartial, eps, d, scale_inv, amax);
  }
  const int64_t rows = cols > 0 ? numel / cols : 0;
  constexpr int VEC = 16 / sizeof(IR);
  const bool vec = (cols * static_cast<int64_t>(sizeof(IR))) % 16 == 0 && aligned(src, 16) && aligned(dst, VEC);
  const bool tvec = rows % 8 == 0 && aligned(dst_t, 8);
  auto k2 = quant_cast_t_kernel<In, F8>;
  const int64_t ntiles = ((rows + kTileR - 1) / kTileR) * ((cols + kTileC - 1) / kTileC);
  return launch_dependent(k2, tile_blocks(reinterpret_cast<const void*>(k2), ntiles), stream, s, rows, cols,
                          static_cast<const uint32_t*>(partial), npartial, eps, d,
                          static_cast<typename F8::raw*>(dst_t), scale_inv, amax, vec, tvec);
}

}  // namespace

int64_t fp8_quantize_workspace_words() { return static_cast<int64_t>(num_sms()) * 32; }  // >= blocks of any grid

uint32_t* fp8_quantize_stream_workspace(void* stream, int* err) {
  return stream_workspace(1, fp8_quantize_workspace_words(), static_cast<cudaStream_t>(stream), err);
}

// kQuantizeFused: one launch; anything else: two-pass. The caller never asks for fused under graph capture.
int launch(const Fp8QuantizeParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_float(p.src_dtype, [&](auto in_tag) {
    return for_fp8(p.dst_dtype, [&](auto out_tag) {
      using In = decltype(in_tag);
      using F8 = decltype(out_tag);
      if (p.algo == kQuantizeFused) {
        return launch_fused<In, F8>(p.src, p.numel, p.cols, p.dst, p.dst_t, p.scale_inv, p.amax, p.eps, s);
      }
      return launch_two_pass<In, F8>(p.src, p.numel, p.cols, p.dst, p.dst_t, p.scale_inv, p.amax, p.eps,
                                     p.workspace, s);
    });
  });
}

int launch(const Fp8TransposeParams& p, void* stream) {
  const int64_t rows = p.rows, cols = p.cols;
  if (rows == 0 || cols == 0) return 0;
  const bool vec = cols % 16 == 0 && rows % 8 == 0 && aligned(p.src, 16) && aligned(p.dst, 8);
  const int64_t ntiles = ((rows + kTileR - 1) / kTileR) * ((cols + kTileC - 1) / kTileC);
  auto kernel = transpose_u8_kernel;
  const int blocks = tile_blocks(reinterpret_cast<const void*>(kernel), ntiles);
  kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const uint8_t*>(p.src), rows, cols,
                                                                      static_cast<uint8_t*>(p.dst), vec);
  return last_error();
}

}  // namespace cuda
}  // namespace mfsdp
