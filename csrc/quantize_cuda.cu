// CUDA kernels of the FP8 activation / gradient quantizer (one tensor, per-tensor current scaling) and of the
// FP8 transpose. Semantics: mfsdp_ext/_native.py (fp8_quantize, fp8_transpose); CPU twins in quantize.cpp.
//
// The scale needs the amax of the whole tensor before the first element can be cast, so there are two ways:
//   two-pass (default): K1 writes one amax per block (no atomics, no memset); K2 reduces those few hundred
//     values in every block, then casts. K2 walks the tensor from the end backwards, so it first re-reads
//     what K1 read last, which is still in L2. K2 is launched as a programmatic dependent launch (sm_90), so
//     its launch overlaps K1's tail.
//   fused: one cooperative kernel that keeps the tensor in registers across a grid-wide barrier (one read of
//     the input), for tensors that fit in the registers of one wave of blocks. A grid barrier needs every
//     block resident: while other kernels (NCCL) hold SMs, the resident blocks wait for them, which is why
//     it is not the default.
// The transposing cast works on 64 x 128 tiles staged in shared memory (XOR-swizzled, conflict-free), writing
// the row-major FP8 tile and its transpose; the FP8 transpose kernel is the same tile walk on FP8 input.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

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
template <class F8>
__device__ __forceinline__ float scale_from_partials(const uint32_t* __restrict__ partial, int64_t n, float eps,
                                                     float* __restrict__ scale_inv, float* __restrict__ amax_out) {
  __shared__ float s_scale;
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = partial[i] > m ? partial[i] : m;
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
};

// ---------------------------------------------------------------------------------------------
// two-pass, K2 with the transposed output: dst (rows, cols) and dst_t (cols, rows)
// vec: cols * sizeof(In) % 16 == 0, rows % 8 == 0, src 16-byte, dst and dst_t 8-byte aligned
// ---------------------------------------------------------------------------------------------
template <class In, class F8>
__global__ void __launch_bounds__(kThreads)
    quant_cast_t_kernel(const typename In::raw* __restrict__ src, int64_t rows, int64_t cols,
                        const uint32_t* __restrict__ partial, int64_t npartial, float eps,
                        typename F8::raw* __restrict__ dst, typename F8::raw* __restrict__ dst_t,
                        float* __restrict__ scale_inv, float* __restrict__ amax_out, bool vec) {
  using IR = typename In::raw;
  constexpr int VEC = 16 / sizeof(IR);                  // source elements per 16-byte load
  constexpr int kLoads = kTileR * kTileC / VEC / kThreads;  // per thread per tile
  constexpr int kVecPerRow = kTileC / VEC;
  __shared__ __align__(16) uint8_t tile[kTileR * kTileC];
  pdl_wait();
  const float scale = scale_from_partials<F8>(partial, npartial, eps, scale_inv, amax_out);
  auto cvt = [&](IR x) -> uint8_t { return F8::store(mul_rn(In::load(x), scale)); };
  const TileGrid tg(rows, cols);
  for (int64_t t = tg.ntiles - 1 - blockIdx.x; t >= 0; t -= gridDim.x) {  // last tiles first (in L2)
    const int64_t r0 = (t / tg.tiles_c) * kTileR, c0 = (t % tg.tiles_c) * kTileC;
    const bool full = vec && r0 + kTileR <= rows && c0 + kTileC <= cols;
    if (full) {
      VecRegs<IR, VEC> v[kLoads];
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int e = i * kThreads + threadIdx.x, r = e / kVecPerRow, j = e % kVecPerRow;
        vload(v[i], src + (r0 + r) * cols + c0 + j * VEC);
      }
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int e = i * kThreads + threadIdx.x, r = e / kVecPerRow, j = e % kVecPerRow;
        uint32_t w[VEC / 4];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const uint32_t b = cvt(v[i].get(k));
          w[k >> 2] = (k & 3) ? (w[k >> 2] | (b << (8 * (k & 3)))) : b;
        }
        uint8_t* out = dst + (r0 + r) * cols + c0 + j * VEC;
        uint32_t* sw = reinterpret_cast<uint32_t*>(tile);
        if constexpr (VEC == 8) {
          *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
          *reinterpret_cast<uint2*>(sw + tile_word(r, 2 * j)) = make_uint2(w[0], w[1]);
        } else {
          *reinterpret_cast<uint32_t*>(out) = w[0];
          sw[tile_word(r, j)] = w[0];
        }
      }
    } else {
      for (int i = threadIdx.x; i < kTileR * kTileC; i += blockDim.x) {
        const int r = i / kTileC, c = i % kTileC;
        if (r0 + r < rows && c0 + c < cols) {
          const uint8_t b = cvt(src[(r0 + r) * cols + c0 + c]);
          dst[(r0 + r) * cols + c0 + c] = b;
          tile[tile_byte(r, c)] = b;
        }
      }
    }
    __syncthreads();
    store_tile_transposed(tile, dst_t, rows, cols, r0, c0, full);
    __syncthreads();  // the tile is rewritten by the next iteration
  }
}

// ---------------------------------------------------------------------------------------------
// fused: one cooperative kernel, the tensor held in registers across the grid barrier
// ---------------------------------------------------------------------------------------------
constexpr int kHold = 8;  // 16-byte source vectors each thread holds

template <class In, class F8>
__global__ void __launch_bounds__(kThreads)
    quant_fused_kernel(const typename In::raw* __restrict__ src, int64_t total, uint32_t* __restrict__ partial,
                       float eps, typename F8::raw* __restrict__ dst, float* __restrict__ scale_inv,
                       float* __restrict__ amax_out) {
  using IR = typename In::raw;
  constexpr int VEC = 16 / sizeof(IR);
  const int64_t nvec = total / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  VecRegs<IR, VEC> v[kHold];
  uint32_t m = 0;
  auto take = [&](IR x) {
    const uint32_t a = f2u(In::load(x)) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  };
#pragma unroll
  for (int k = 0; k < kHold; ++k) {
    if (g + k * stride < nvec) vload(v[k], src + (g + k * stride) * VEC);
  }
#pragma unroll
  for (int k = 0; k < kHold; ++k) {
    if (g + k * stride < nvec) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) take(v[k].get(e));
    }
  }
  const int64_t tail = nvec * VEC + g;  // the last total % VEC elements, one per thread
  IR tv = 0;
  if (tail < total) {
    tv = src[tail];
    take(tv);
  }
  m = block_max_u32(m);
  if (threadIdx.x == 0) partial[blockIdx.x] = m;
  cooperative_groups::this_grid().sync();
  const float scale = scale_from_partials<F8>(partial, gridDim.x, eps, scale_inv, amax_out);
  auto cvt = [&](IR x) -> uint32_t { return F8::store(mul_rn(In::load(x), scale)); };
#pragma unroll
  for (int k = 0; k < kHold; ++k) {
    const int64_t i = g + k * stride;
    if (i < nvec) {
      uint32_t w[VEC / 4];
#pragma unroll
      for (int e = 0; e < VEC; ++e) w[e >> 2] = (e & 3) ? (w[e >> 2] | (cvt(v[k].get(e)) << (8 * (e & 3)))) : cvt(v[k].get(e));
      if constexpr (VEC == 8) {
        *reinterpret_cast<uint2*>(dst + i * VEC) = make_uint2(w[0], w[1]);
      } else {
        *reinterpret_cast<uint32_t*>(dst + i * VEC) = w[0];
      }
    }
  }
  if (tail < total) dst[tail] = static_cast<typename F8::raw>(cvt(tv));
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

// elements one full wave holds (the smaller of the two FP8 outputs' occupancies)
template <class In>
int64_t fused_capacity_of() {
  const int b4 = blocks_per_sm(reinterpret_cast<const void*>(quant_fused_kernel<In, E4M3T>));
  const int b5 = blocks_per_sm(reinterpret_cast<const void*>(quant_fused_kernel<In, E5M2T>));
  const int64_t blocks = static_cast<int64_t>(num_sms()) * (b4 < b5 ? b4 : b5);
  return blocks * kThreads * kHold * static_cast<int64_t>(16 / sizeof(typename In::raw));
}

template <class In, class F8>
int launch_fused(const void* src, int64_t numel, void* dst, float* scale_inv, float* amax, float eps,
                 uint32_t* partial, cudaStream_t stream) {
  auto kernel = quant_fused_kernel<In, F8>;
  // every SM takes part (one vector per thread at least), up to one full wave
  const int64_t max_blocks = static_cast<int64_t>(num_sms()) * blocks_per_sm(reinterpret_cast<const void*>(kernel));
  const int64_t want = (numel / (16 / sizeof(typename In::raw)) + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 1 ? 1 : (want < max_blocks ? want : max_blocks));
  auto* s = static_cast<const typename In::raw*>(src);
  auto* d = static_cast<typename F8::raw*>(dst);
  void* args[] = {&s, &numel, &partial, &eps, &d, &scale_inv, &amax};
  return static_cast<int>(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(blocks),
                                                      dim3(kThreads), args, 0, stream));
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
  const bool vec = (cols * static_cast<int64_t>(sizeof(IR))) % 16 == 0 && rows % 8 == 0 && aligned(src, 16) &&
                   aligned(dst, 8) && aligned(dst_t, 8);
  auto k2 = quant_cast_t_kernel<In, F8>;
  const int64_t ntiles = ((rows + kTileR - 1) / kTileR) * ((cols + kTileC - 1) / kTileC);
  return launch_dependent(k2, tile_blocks(reinterpret_cast<const void*>(k2), ntiles), stream, s, rows, cols,
                          static_cast<const uint32_t*>(partial), npartial, eps, d,
                          static_cast<typename F8::raw*>(dst_t), scale_inv, amax, vec);
}

}  // namespace

int64_t fp8_quantize_workspace_words() { return static_cast<int64_t>(num_sms()) * 32; }  // >= blocks of any grid

int64_t fp8_quantize_fused_capacity(DType in) {
  switch (in) {
    case kF32: return fused_capacity_of<F32T>();
    case kBF16: return fused_capacity_of<BF16T>();
    case kF16: return fused_capacity_of<F16T>();
    default: return 0;
  }
}

bool fp8_quantize_fused_fits(const void* src, DType in, int64_t numel, const void* dst) {
  const int64_t vec = in == kF32 ? 4 : 8;
  return aligned(src, 16) && aligned(dst, static_cast<uintptr_t>(vec)) && numel <= fp8_quantize_fused_capacity(in);
}

int fp8_quantize(const void* src, DType in, int64_t numel, int64_t cols, void* dst, void* dst_t, DType out,
                 float* scale_inv, float* amax, float eps, int algo, uint32_t* workspace, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_float(in, [&](auto in_tag) {
    return for_fp8(out, [&](auto out_tag) {
      using In = decltype(in_tag);
      using F8 = decltype(out_tag);
      if (algo == kQuantizeFused) return launch_fused<In, F8>(src, numel, dst, scale_inv, amax, eps, workspace, s);
      return launch_two_pass<In, F8>(src, numel, cols, dst, dst_t, scale_inv, amax, eps, workspace, s);
    });
  });
}

int fp8_transpose(const void* src, int64_t rows, int64_t cols, void* dst, void* stream) {
  if (rows == 0 || cols == 0) return 0;
  const bool vec = cols % 16 == 0 && rows % 8 == 0 && aligned(src, 16) && aligned(dst, 8);
  const int64_t ntiles = ((rows + kTileR - 1) / kTileR) * ((cols + kTileC - 1) / kTileC);
  auto kernel = transpose_u8_kernel;
  const int blocks = tile_blocks(reinterpret_cast<const void*>(kernel), ntiles);
  kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const uint8_t*>(src), rows, cols,
                                                                      static_cast<uint8_t*>(dst), vec);
  return last_error();
}

}  // namespace cuda
}  // namespace mfsdp
