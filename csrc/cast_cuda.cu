// CUDA kernels of the main->model cast: plain cast (fp32 -> bf16 / fp16), per-segment amax, FP8 cast with
// per-segment current scaling, FP8 dequantize, and the fp32 gradient accumulation.
// Per-segment data (segment bounds, amax, scales) is read from small device tables. The CPU versions of these
// kernels are in cast_cpu.cpp; the launchers' contract is in launch.h.
#include <cuda_runtime.h>

#include "fp8_scaling.h"
#include "kernel_utils.cuh"
#include "launch.h"

namespace mfsdp {
namespace cuda {
namespace {

using namespace detail;

// ---------------------------------------------------------------------------------------------
// cast
// ---------------------------------------------------------------------------------------------
template <class In, class Out>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const typename In::raw* __restrict__ src, typename Out::raw* __restrict__ dst, int64_t total,
                int64_t chunk, int64_t nchunks) {
  for_each_chunk(chunk, nchunks, total, [&](int64_t b0, int64_t b1) {
    CopyOp<In, Out> op{src + b0, dst + b0, 1.0f, false};
    run_range(op, b1 - b0);
  });
}

template <class In, class Out>
int launch_cast(const void* src, void* dst, int64_t numel, cudaStream_t stream) {
  auto kernel = cast_kernel<In, Out>;
  const Grid g = make_grid(reinterpret_cast<const void*>(kernel), numel);
  kernel<<<g.blocks, kThreads, 0, stream>>>(static_cast<const typename In::raw*>(src),
                                            static_cast<typename Out::raw*>(dst), numel, g.chunk, g.nchunks);
  return last_error();
}

// ---------------------------------------------------------------------------------------------
// segment amax: amax_bits[i] = max over the segment of |x| as fp32 bits (zeroed before the launch)
// ---------------------------------------------------------------------------------------------
template <class In>
__global__ void __launch_bounds__(kThreads)
    segment_amax_kernel(const typename In::raw* __restrict__ src, int64_t total, const int64_t* __restrict__ seg,
                        int64_t nseg, int64_t chunk, int64_t nchunks, uint32_t* __restrict__ amax_bits) {
  // each thread keeps the running max of the block's current segment; the block reduces it and does one
  // atomicMax when it moves on to another segment (and at the end)
  int64_t cur = -1;
  uint32_t m = 0;
  auto flush = [&]() {
    const uint32_t r = block_max_u32(m);
    if (threadIdx.x == 0 && r != 0u) atomicMax(amax_bits + cur, r);
  };
  for_each_chunk_of_segments(
      src, chunk, nchunks, total, seg, nseg,
      [&](int64_t i, int64_t p, int64_t q) {
        if (i != cur) {
          if (cur >= 0) flush();
          cur = i;
          m = 0;
        }
        AmaxOp<In> op{src + p, m};
        run_range(op, q - p);
        m = op.m;
      },
      [&](int64_t, int64_t) {});
  if (cur >= 0) flush();
}

template <class In>
int launch_amax(const void* src, int64_t numel, const int64_t* seg, int64_t nseg, float* amax,
                cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(amax, 0, static_cast<size_t>(nseg) * sizeof(float), stream);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (numel == 0) return 0;
  auto kernel = segment_amax_kernel<In>;
  const Grid g = make_grid(reinterpret_cast<const void*>(kernel), numel);
  kernel<<<g.blocks, kThreads, 0, stream>>>(static_cast<const typename In::raw*>(src), numel, seg, nseg, g.chunk,
                                            g.nchunks, reinterpret_cast<uint32_t*>(amax));
  return last_error();
}

// ---------------------------------------------------------------------------------------------
// per-segment scaled copy (FP8 cast and dequantize): dst = src * scale_of(i) in segment i, 0 in the gaps
// ---------------------------------------------------------------------------------------------
template <class In, class Out, class ScaleOf>
__device__ __forceinline__ void scaled_segment_copy(const typename In::raw* __restrict__ src,
                                                    typename Out::raw* __restrict__ dst, int64_t total,
                                                    const int64_t* __restrict__ seg, int64_t nseg, int64_t chunk,
                                                    int64_t nchunks, ScaleOf&& scale_of) {
  for_each_chunk_of_segments(
      src, chunk, nchunks, total, seg, nseg,
      [&](int64_t i, int64_t p, int64_t q) {
        CopyOp<In, Out> op{src + p, dst + p, scale_of(i), true};
        run_range(op, q - p);
      },
      [&](int64_t p, int64_t q) {
        ZeroOp<Out> op{dst + p};
        run_range(op, q - p);
      });
}

// ---------------------------------------------------------------------------------------------
// fp8 cast with per-segment scales; gaps are written as 0; scale_inv[i] = 1 / scale_i
// ---------------------------------------------------------------------------------------------
template <class In, class F8>
__global__ void __launch_bounds__(kThreads)
    fp8_cast_kernel(const typename In::raw* __restrict__ src, int64_t total, const int64_t* __restrict__ seg,
                    int64_t nseg, int64_t chunk, int64_t nchunks, const float* __restrict__ amax, float eps,
                    typename F8::raw* __restrict__ dst, float* __restrict__ scale_inv) {
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = gtid; i < nseg; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    scale_inv[i] = fp8_scale_inv(fp8_scale(amax[i], F8::max_value, eps));
  }
  scaled_segment_copy<In, F8>(src, dst, total, seg, nseg, chunk, nchunks,
                              [&](int64_t i) { return fp8_scale(amax[i], F8::max_value, eps); });
}

template <class In, class F8>
int launch_fp8_cast(const void* src, int64_t numel, const int64_t* seg, int64_t nseg, const float* amax,
                    float eps, void* dst, float* scale_inv, cudaStream_t stream) {
  auto kernel = fp8_cast_kernel<In, F8>;
  if (numel == 0 && nseg == 0) return 0;
  const Grid g = make_grid(reinterpret_cast<const void*>(kernel), numel);  // at least one block (scale_inv)
  kernel<<<g.blocks, kThreads, 0, stream>>>(static_cast<const typename In::raw*>(src), numel, seg, nseg, g.chunk,
                                            g.nchunks, amax, eps, static_cast<typename F8::raw*>(dst), scale_inv);
  return last_error();
}

// ---------------------------------------------------------------------------------------------
// fp8 dequantize: dst = src * scale_inv[i] in fp32, cast to dst's dtype; gaps 0
// ---------------------------------------------------------------------------------------------
template <class F8, class Out>
__global__ void __launch_bounds__(kThreads)
    fp8_dequant_kernel(const typename F8::raw* __restrict__ src, int64_t total, const int64_t* __restrict__ seg,
                       int64_t nseg, int64_t chunk, int64_t nchunks, const float* __restrict__ scale_inv,
                       typename Out::raw* __restrict__ dst) {
  scaled_segment_copy<F8, Out>(src, dst, total, seg, nseg, chunk, nchunks, [&](int64_t i) { return scale_inv[i]; });
}

template <class F8, class Out>
int launch_dequant(const void* src, int64_t numel, const int64_t* seg, int64_t nseg, const float* scale_inv,
                   void* dst, cudaStream_t stream) {
  if (numel == 0) return 0;
  auto kernel = fp8_dequant_kernel<F8, Out>;
  const Grid g = make_grid(reinterpret_cast<const void*>(kernel), numel);
  kernel<<<g.blocks, kThreads, 0, stream>>>(static_cast<const typename F8::raw*>(src), numel, seg, nseg, g.chunk,
                                            g.nchunks, scale_inv, static_cast<typename Out::raw*>(dst));
  return last_error();
}

// ---------------------------------------------------------------------------------------------
// grad accumulate
// ---------------------------------------------------------------------------------------------
// Several parts, everything 16-byte aligned and numel a multiple of 8 (fully_shard's shards): each thread reads 8
// elements of every part and writes its 8 main_grad elements once, in a grid-stride loop. The rounding is that
// of one call per part (main_grad's dtype after each part), so the result does not depend on the path.
template <class Main, class Red>
__global__ void __launch_bounds__(kThreads)
    grad_acc_parts_kernel(typename Main::raw* __restrict__ main_grad, const typename Red::raw* __restrict__ red,
                          int64_t total, float scale, bool accumulate, int64_t parts) {
  using MR = typename Main::raw;
  using RR = typename Red::raw;
  constexpr int V = 8;
  static_assert((V * sizeof(MR)) % 16 == 0 && (V * sizeof(RR)) % 16 == 0, "8 elements: whole 16-byte vectors");
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
  for (int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; j < total; j += stride) {
    float acc[V];
    VecRegs<RR, V> r;
    vload(r, red + j);
    if (accumulate) {
      VecRegs<MR, V> m;
      vload(m, main_grad + j);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        acc[k] = Main::load(Main::store(fma_rn(scale, Red::load(r.get(k)), Main::load(m.get(k)))));
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = Main::load(Main::store(mul_rn(scale, Red::load(r.get(k)))));
    }
    for (int64_t part = 1; part < parts; ++part) {
      vload(r, red + part * total + j);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = Main::load(Main::store(fma_rn(scale, Red::load(r.get(k)), acc[k])));
    }
    VecRegs<MR, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.set(k, Main::store(acc[k]));
    vstore(main_grad + j, out);
  }
}

// Several parts otherwise: a block adds them into its chunk one after the other, so the chunk of main_grad it
// rewrites (<= 64 KiB) is re-read from L2, not memory; the threads meet between parts (each part's pass may
// split the chunk among them differently when its source is aligned differently).
template <class Main, class Red>
__global__ void __launch_bounds__(kThreads)
    grad_acc_kernel(typename Main::raw* __restrict__ main_grad, const typename Red::raw* __restrict__ red,
                    int64_t total, int64_t chunk, int64_t nchunks, float scale, bool accumulate, int64_t parts) {
  for_each_chunk(chunk, nchunks, total, [&](int64_t b0, int64_t b1) {
    for (int64_t part = 0; part < parts; ++part) {
      if (part > 0) __syncthreads();
      GradAccOp<Main, Red> op{main_grad + b0, red + part * total + b0, scale, accumulate || part > 0};
      run_range(op, b1 - b0);
    }
  });
}

template <class Main, class Red>
int launch_grad_acc(void* main_grad, const void* red, int64_t numel, float scale, bool accumulate, int64_t parts,
                    cudaStream_t stream) {
  if (numel == 0) return 0;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (parts > 1 && numel % 8 == 0 && aligned(main_grad) && aligned(red)) {
    auto kernel = grad_acc_parts_kernel<Main, Red>;
    const int64_t vectors = numel / 8;
    const int64_t max_blocks = static_cast<int64_t>(num_sms()) * blocks_per_sm(reinterpret_cast<const void*>(kernel));
    const int64_t need = (vectors + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(need < max_blocks ? need : max_blocks);
    kernel<<<blocks, kThreads, 0, stream>>>(static_cast<typename Main::raw*>(main_grad),
                                            static_cast<const typename Red::raw*>(red), numel, scale, accumulate,
                                            parts);
    return last_error();
  }
  auto kernel = grad_acc_kernel<Main, Red>;
  const Grid g = make_grid(reinterpret_cast<const void*>(kernel), numel);
  kernel<<<g.blocks, kThreads, 0, stream>>>(static_cast<typename Main::raw*>(main_grad),
                                            static_cast<const typename Red::raw*>(red), numel, g.chunk,
                                            g.nchunks, scale, accumulate, parts);
  return last_error();
}

}  // namespace

int launch(const CastParams& p, void* stream) {
  if (p.numel == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_float(p.src_dtype, [&](auto in_tag) {
    return for_float(p.dst_dtype, [&](auto out_tag) {
      return launch_cast<decltype(in_tag), decltype(out_tag)>(p.src, p.dst, p.numel, s);
    });
  });
}

int launch(const SegmentAmaxParams& p, void* stream) {
  if (p.num_segments == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_float(p.src_dtype, [&](auto in_tag) {
    return launch_amax<decltype(in_tag)>(p.src, p.numel, p.segments, p.num_segments, p.amax, s);
  });
}

int launch(const Fp8CastParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_float(p.src_dtype, [&](auto in_tag) {
    return for_fp8(p.dst_dtype, [&](auto out_tag) {
      return launch_fp8_cast<decltype(in_tag), decltype(out_tag)>(p.src, p.numel, p.segments, p.num_segments, p.amax,
                                                                    p.eps, p.dst, p.scale_inv, s);
    });
  });
}

int launch(const Fp8DequantizeParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_fp8(p.src_dtype, [&](auto in_tag) {
    return for_float(p.dst_dtype, [&](auto out_tag) {
      return launch_dequant<decltype(in_tag), decltype(out_tag)>(p.src, p.numel, p.segments, p.num_segments,
                                                                 p.scale_inv, p.dst, s);
    });
  });
}

int launch(const GradAccumulateParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_float(p.main_grad_dtype, [&](auto main_tag) {
    return for_float(p.reduced_dtype, [&](auto red_tag) {
      return launch_grad_acc<decltype(main_tag), decltype(red_tag)>(p.main_grad, p.reduced, p.numel, p.scale,
                                                                     p.accumulate, p.parts, s);
    });
  });
}

}  // namespace cuda
}  // namespace mfsdp
