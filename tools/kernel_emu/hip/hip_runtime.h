// A CPU emulation of the few CUDA/HIP builtins the kda_chunk kernels use:
// one block at a time, one std::thread per CUDA thread, __syncthreads as a
// std::barrier, warp shuffles through a per-warp exchange.
#pragma once
#include <cmath>
#include <cstring>
#include <barrier>
#include <thread>
#include <vector>
#include <functional>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
extern thread_local dim3 threadIdx;
extern dim3 blockIdx, blockDim, gridDim;
struct BlockSync;
extern thread_local BlockSync* hk_sync;
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#ifdef HK_EMU_STATIC_SHARED
// Blocks run one at a time: a static array is the block's shared one, and
// the dynamic shared memory is one array of emu.cpp's (for kernels with
// static __shared__ arrays; needs a prelude that leaves HK_DYN_SMEM to us).
#define __shared__ static
extern double hk_dyn_smem[];
#define HK_DYN_SMEM(type, name) type* name = (type*)hk_dyn_smem
#else
#define __shared__
#endif
#define __launch_bounds__(...)
#define __restrict__
void __syncthreads();
float __shfl_xor(float v, int m, int w);
float __shfl(float v, int src, int w);
unsigned __shfl(unsigned v, int src, int w);
double __shfl_xor(double v, int m, int w);
int __shfl_xor(int v, int m, int w);
double __shfl(double v, int src, int w);
int __any(int p);
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline double __longlong_as_double(long long i) { double f; memcpy(&f, &i, 8); return f; }
static inline long long __double_as_longlong(double f) { long long i; memcpy(&i, &f, 8); return i; }
#include <math.h>
// For step_mm.hip (st_mm_few's counters and its partials' stores).
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
