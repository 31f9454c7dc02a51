// The prelude of every CUDA source bbrules generates: codegen/cuda_gen.py copies it in, so that
// a module stays one self-contained source for CuPy's NVRTC.
//
// The same source is also compiled as C++ by the test emulator (tests/cuda_emu), which has no
// CUDA headers and runs a kernel at any thread count.  Whatever here uses a device feature has a
// portable branch for the emulator, chosen by __CUDA_ARCH__ (defined only for device code).

#define BB_INF __int_as_float(0x7f800000)
#define BB_NAN __int_as_float(0x7fffffff)

// The threads per block of a kernel compiled for n: on the device, the constant n (the kernel is
// always launched with it, and __launch_bounds__ says so), so the threads' strided loops have
// constant trip counts that nvcc unrolls, and every split of work over the threads is decided
// at compile time.  The emulator launches any count, to check that every count computes the same
// values, so there it is the launch's.
//
// BB_PER_THREAD(size, n) is how many of `size` elements one of n threads owns in a strided loop
// (an array of registers), and BB_UNROLL unrolls such a loop fully, so that the array's every
// index is a constant and it stays in registers.  The emulator's arrays are sized for any count
// of threads, and it ignores the pragma (which g++ would warn about).
#ifdef __CUDA_ARCH__
#define BB_THREADS(n) (n)
#define BB_PER_THREAD(size, n) (((size) + (n) - 1) / (n))
#define BB_UNROLL _Pragma("unroll")
#else
#define BB_THREADS(n) ((int)blockDim.x)
#define BB_PER_THREAD(size, n) (size)
#define BB_UNROLL
#endif

// 16-bit tensors are stored as their bits (unsigned short) and computed on as floats.  On the
// device each conversion is the one hardware instruction that __half2float, __float2half_rn and
// __float2bfloat16_rn compile to, written as PTX so that no cuda_fp16.h or cuda_bf16.h is needed
// (CuPy's NVRTC does not always find the bf16 header: cupy/cupy#8146).  bf16 to float is a shift
// either way.  The emulator rounds the same way in bit arithmetic: to nearest even, overflowing
// to infinity, NaN staying NaN.

__device__ __forceinline__ float bb_h2f(unsigned short h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    unsigned int u = ((unsigned int)h & 0x7fffu) << 13;
    const unsigned int e = u & 0x0f800000u;
    u += 0x38000000u;
    float f;
    if (e == 0x0f800000u) {
        f = __uint_as_float(u + 0x38000000u);
    } else if (e == 0u) {
        f = __uint_as_float(u + 0x00800000u) - __uint_as_float(0x38800000u);
    } else {
        f = __uint_as_float(u);
    }
    return __uint_as_float(__float_as_uint(f) | (((unsigned int)h & 0x8000u) << 16));
#endif
}

__device__ __forceinline__ unsigned short bb_f2h(float x) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    unsigned int h;
    if (u >= 0x47800000u) {
        h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {
        h = __float_as_uint(__uint_as_float(u) + __uint_as_float(0x3f000000u)) - 0x3f000000u;
    } else {
        h = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    }
    return (unsigned short)(h | sign);
#endif
}

__device__ __forceinline__ float bb_b2f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ unsigned short bb_f2b(float x) {
#ifdef __CUDA_ARCH__
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
    return b;
#else
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// 16-byte global loads: four floats, or eight 16-bit values, in one instruction.  The generator
// uses them only for tile rows made of whole vectors at 16-byte aligned offsets, and the
// launcher passes every tensor 16-byte aligned.  The emulator copies the bytes (any alignment).

struct alignas(16) bb_f32x4 {
    float v[4];
};

struct alignas(16) bb_u16x8 {
    unsigned short v[8];
};

__device__ __forceinline__ bb_f32x4 bb_load_f32x4(const float* p) {
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const bb_f32x4*>(p);
#else
    bb_f32x4 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
#endif
}

__device__ __forceinline__ bb_u16x8 bb_load_u16x8(const unsigned short* p) {
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const bb_u16x8*>(p);
#else
    bb_u16x8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
#endif
}
