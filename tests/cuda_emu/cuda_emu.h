// A small emulation of the CUDA execution model, so that generated kernel source can be compiled
// as C++ (g++ -std=c++20 -pthread) and its numerics checked on machines without a GPU.
//
// What it models: one thread block at a time (blocks run one after another); every thread of
// the block is a std::thread with its own threadIdx, and __syncthreads() is a std::barrier across
// them, so each thread's sequence of steps and the block-wide synchronisation are those of the
// real kernel.  Dynamic shared memory (`extern __shared__ float bb_smem[]`) is one array that
// every thread of the current block sees; it is filled with NaN before each block, so a read of
// shared memory that was never written shows up in the results.  The math intrinsics the
// generator uses map to their <cmath> counterparts (rsqrtf to 1/sqrtf).
//
// What it cannot show: warp-level behaviour (no lockstep execution, no shuffles or votes, no
// warp-synchronous shortcuts -- the generator must not rely on them); the CUDA memory model (a
// missing barrier can still give the right answer here, since CPU threads interleave
// differently from warps -- the ThreadSanitizer build in harness.py reports such races instead,
// but only on the paths one run takes); rounding details (CUDA's expf/tanhf and fused
// multiply-add differ from glibc's in the last bits); and anything about performance,
// occupancy, register or shared-memory limits (nvcc checks the limits).
#pragma once

#include <algorithm>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

struct bb_uint3 {
    unsigned int x = 0, y = 0, z = 0;
};

inline thread_local bb_uint3 threadIdx;
inline thread_local bb_uint3 blockIdx;
inline thread_local bb_uint3 blockDim;
inline thread_local bb_uint3 gridDim;

#define __global__
#define __device__ static
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

// 227 KiB: the most dynamic shared memory a thread block can have on sm_90.
constexpr std::size_t bb_emu_smem_floats = 227 * 1024 / sizeof(float);
alignas(16) inline float bb_smem[bb_emu_smem_floats];

namespace bb_emu {
inline thread_local std::barrier<>* block_barrier = nullptr;
}

inline void __syncthreads() { bb_emu::block_barrier->arrive_and_wait(); }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline float __uint_as_float(unsigned int u) { return std::bit_cast<float>(u); }
inline unsigned int __float_as_uint(float f) { return std::bit_cast<unsigned int>(f); }

namespace bb_emu {

// Run `kernel` over `grid` blocks of `threads` threads, blocks one after another.
inline void launch(unsigned grid, unsigned threads, std::size_t shared_bytes,
                   const std::function<void()>& kernel) {
    std::barrier<> barrier(threads);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            blockDim = {threads, 1, 1};
            gridDim = {grid, 1, 1};
            block_barrier = &barrier;
            for (unsigned b = 0; b < grid; ++b) {
                if (t == 0) {
                    std::fill(bb_smem, bb_smem + shared_bytes / sizeof(float),
                              std::numeric_limits<float>::quiet_NaN());
                }
                blockIdx = {b, 0, 0};
                barrier.arrive_and_wait();
                kernel();
                barrier.arrive_and_wait();
            }
        });
    }
    for (auto& th : pool) th.join();
}

}  // namespace bb_emu
