// CUDA thread blocks on the CPU, for checking kq_search.cu's CUDA kernels where there is no GPU (CI).
//
// quantkit.testing.cuda_emulation compiles kq_search.cu's CUDA branch with the C++ compiler against this header:
// each thread of a block is a fiber (ucontext) with its own stack, the block's fibers take turns, each running until
// it reaches a sync point, and the blocks of a launch run one after another.  Shuffles, __syncwarp and
// __syncthreads are barriers over the threads that take part.  What is undefined on a GPU is an error here: a
// shuffle that reads a lane outside its mask, lanes of one warp meeting at barriers of different masks, threads
// that can never all arrive.  The arithmetic is the C++ compiler's float32 (built with -ffp-contract=off, as nvcc
// builds the kernels with -fmad=false); __shared__ arrays are function statics, shared by the block being run.
#pragma once

#include <ucontext.h>

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#define QK_EMULATED_CUDA 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace qk_emu {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 << 10;

struct Barrier {
    int arrived = 0;
    unsigned long generation = 0;
    unsigned mask = 0;
};

struct Fiber {
    ucontext_t context;
    dim3 thread_idx;
    int lane = 0, warp = 0;
    bool done = false;
    std::unique_ptr<char[]> stack;
};

struct Launch {
    dim3 grid, block, block_idx;
    std::function<void()> body;
    std::vector<Fiber> fibers;
    std::vector<Barrier> warp_barriers;
    std::vector<uint64_t> slots;     // each thread's value in the shuffle under way
    Barrier block_barrier;
    ucontext_t scheduler;
    Fiber* current = nullptr;
    int alive = 0;
    bool progressed = false;
    std::string error;
    uint64_t seed = 0x9E3779B97F4A7C15ull;

    uint64_t random() {     // xorshift64*
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        return seed * 0x2545F4914F6CDD1Dull;
    }
};

inline Launch*& active() {
    static thread_local Launch* launch = nullptr;
    return launch;
}

inline Launch& now() { return *active(); }

// Back to the scheduler; it resumes this fiber on its next round.
inline void yield() { swapcontext(&now().current->context, &now().scheduler); }

// Stop the launch: the scheduler never resumes a fiber again and the launch raises the message.
[[noreturn]] inline void fail(const std::string& message) {
    now().error = message;
    for (;;) yield();
}

inline void fiber_main() {
    Launch& l = now();
    l.body();
    l.current->done = true;
    --l.alive;
    l.progressed = true;
}   // returns to the scheduler through uc_link

// Wait until `expected()` threads have arrived at `b` (re-evaluated: threads that exit no longer count).
template <class Expected>
inline void wait(Barrier& b, unsigned mask, Expected expected) {
    Launch& l = now();
    if (b.arrived == 0) b.mask = mask;
    else if (b.mask != mask) fail("threads of one warp wait at barriers of different masks");
    const unsigned long generation = b.generation;
    ++b.arrived;
    l.progressed = true;
    while (b.generation == generation) {
        if (b.arrived >= expected()) {
            b.arrived = 0;
            ++b.generation;
            l.progressed = true;
        }
        yield();    // even the last to arrive: all go on in the scheduler's order of the next round
    }
}

inline void warp_wait(unsigned mask) {
    Fiber& f = *now().current;
    if (!((mask >> f.lane) & 1u)) fail("a lane takes part in a warp operation whose mask leaves it out");
    const int count = __builtin_popcount(mask);
    wait(now().warp_barriers[f.warp], mask, [count] { return count; });
}

// Every lane of `mask` publishes `v`; each gets the value of lane `src` (of its warp).
template <class T>
inline T exchange(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 8 bytes");
    Launch& l = now();
    Fiber& f = *l.current;
    uint64_t* slots = &l.slots[(size_t)f.warp * kWarp];
    std::memcpy(&slots[f.lane], &v, sizeof(T));
    warp_wait(mask);
    if (!((mask >> src) & 1u)) fail("a shuffle reads a lane outside its mask");
    T r;
    std::memcpy(&r, &slots[src], sizeof(T));
    warp_wait(mask);    // nobody overwrites a slot before every lane has read it
    return r;
}

inline int lane() { return now().current->lane; }

inline void run_block(Launch& l) {
    const unsigned bx = l.block.x, by = l.block.y;
    const int n = (int)(l.block.x * l.block.y * l.block.z);
    l.alive = n;
    l.block_barrier = Barrier();
    l.warp_barriers.assign((n + kWarp - 1) / kWarp, Barrier());
    l.slots.assign((size_t)l.warp_barriers.size() * kWarp, 0);
    for (int t = 0; t < n; ++t) {
        Fiber& f = l.fibers[t];
        f.done = false;
        f.thread_idx = dim3(t % bx, (t / bx) % by, t / (bx * by));
        f.lane = t % kWarp;
        f.warp = t / kWarp;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.get();
        f.context.uc_stack.ss_size = kStackBytes;
        f.context.uc_link = &l.scheduler;
        makecontext(&f.context, fiber_main, 0);
    }
    // Each round runs the threads in a new order (seeded: every run the same), so that a missing barrier shows
    // whichever side of it a thread depends on.
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    while (l.alive > 0 && l.error.empty()) {
        l.progressed = false;
        for (int i = n - 1; i > 0; --i) std::swap(order[i], order[l.random() % (uint64_t)(i + 1)]);
        for (int i = 0; i < n && l.error.empty(); ++i) {
            Fiber& f = l.fibers[order[i]];
            if (f.done) continue;
            l.current = &f;
            swapcontext(&l.scheduler, &f.context);
        }
        if (l.error.empty() && l.alive > 0 && !l.progressed)
            l.error = "threads wait at barriers that can never complete";
    }
}

// A launch of kernel(args) on grid x block threads: quantkit.testing.cuda_emulation rewrites each launch into one.
inline void launch(std::function<void()> body, dim3 grid, dim3 block, size_t = 0, void* = nullptr) {
    Launch l;
    l.grid = grid;
    l.block = block;
    l.body = std::move(body);
    l.fibers.resize((size_t)block.x * block.y * block.z);
    for (Fiber& f : l.fibers) f.stack.reset(new char[kStackBytes]);
    Launch* outer = active();
    active() = &l;
    for (unsigned z = 0; z < grid.z && l.error.empty(); ++z)
        for (unsigned y = 0; y < grid.y && l.error.empty(); ++y)
            for (unsigned x = 0; x < grid.x && l.error.empty(); ++x) {
                l.block_idx = dim3(x, y, z);
                run_block(l);
            }
    active() = outer;
    TORCH_CHECK(l.error.empty(), "emulated CUDA launch: ", l.error);
}

}  // namespace qk_emu

#define threadIdx (::qk_emu::now().current->thread_idx)
#define blockIdx (::qk_emu::now().block_idx)
#define blockDim (::qk_emu::now().block)
#define gridDim (::qk_emu::now().grid)
#define warpSize 32

inline void __syncthreads() {
    ::qk_emu::Launch& l = ::qk_emu::now();
    ::qk_emu::wait(l.block_barrier, 0u, [&l] { return l.alive; });
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::qk_emu::warp_wait(mask); }

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = warpSize) {
    const int lane = ::qk_emu::lane(), base = lane & ~(width - 1);
    return ::qk_emu::exchange(mask, v, base + (src & (width - 1)));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
    const int lane = ::qk_emu::lane(), src = lane ^ lane_mask;
    return ::qk_emu::exchange(mask, v, ((src ^ lane) & ~(width - 1)) ? lane : src);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    const int lane = ::qk_emu::lane(), in_segment = lane & (width - 1);
    return ::qk_emu::exchange(mask, v, in_segment + (int)delta < width ? lane + (int)delta : lane);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    const int lane = ::qk_emu::lane(), in_segment = lane & (width - 1);
    return ::qk_emu::exchange(mask, v, in_segment >= (int)delta ? lane - (int)delta : lane);
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline int __float_as_int(float v) { int i; std::memcpy(&i, &v, 4); return i; }

struct __half { uint16_t bits; };
inline __half __ushort_as_half(unsigned short h) { return __half{h}; }
inline float __half2float(__half h) { return c10::detail::fp16_ieee_to_fp32_value(h.bits); }

// The host side of kq_search.cu's launches: two multiprocessors of one resident block each, so that the persistent
// kernels' grid-stride loops run more than once on small inputs.
using cudaError_t = int;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount };
inline cudaError_t cudaGetDevice(int* device) { *device = 0; return 0; }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) { *value = 2; return 0; }
template <class Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
    *blocks = 1;
    return 0;
}
#define C10_CUDA_CHECK(call) TORCH_CHECK((call) == 0, "emulated CUDA call failed")
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)
namespace c10 { namespace cuda { inline void* getCurrentCUDAStream() { return nullptr; } } }
