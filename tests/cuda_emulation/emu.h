// A tiny single-OS-thread CUDA emulator, enough to run attnres's kernels
// (src/cuda) on the CPU with g++ (tests/cuda_emulation/driver.cc,
// scripts/cuda_emulate.sh). Not part of the library or of its build.
//
// Model:
//   - every GPU thread of a CTA is a ucontext fiber with its own stack; the CTAs
//     of a grid run one after another, each to completion;
//   - __syncthreads is a CTA barrier, __shfl_xor_sync a warp barrier that
//     exchanges 64-bit slots; fibers switch only there (cooperatively), so
//     shared memory is coherent at every barrier, as the CUDA memory model
//     promises, and nowhere else matters;
//   - a thread that returns leaves the barriers (live counts drop), as on
//     sm_70+ where exited threads do not block bar.sync;
//   - `__shared__` becomes `static` (one CTA at a time, so one copy suffices);
//     dynamic shared memory (common.cuh: ATTNRES_DYNAMIC_SHARED, defined for
//     ATTNRES_CUDA_EMULATOR) is a pointer into emu::dyn_smem, which is
//     poisoned with 0xFF bytes (NaN as a float) before every CTA so that reads
//     of unwritten shared memory show up, even where they are multiplied by
//     zero;
//   - cache hints (__ldcg, __ldcs, __stcs) are plain loads and stores;
//   - asynchronous copies (common.cuh: AsyncCopyChunk, AsyncCommit, AsyncWait,
//     with ATTNRES_CUDA_EMULATOR defined) are queued per thread and performed
//     only when a wait retires their group; until then the destination holds
//     0xFF bytes, so a read that comes before its wait sees NaN.
// What it cannot see: data races between threads (fibers interleave only at
// barriers), memory-model/visibility bugs, warp-divergence issues of
// __shfl_xor_sync with a partial mask, launch-bound or register limits, and
// the exact rounding of the device math library (exp, fma contraction): the
// driver therefore compares against the float64 reference with SPEC §3
// tolerances, and compares emulated runs bit for bit only with each other.
#pragma once
#define ATTNRES_CUDA_EMULATOR 1
// Fibers switch with _setjmp/_longjmp (no signal-mask syscall, unlike
// swapcontext); glibc's fortified longjmp refuses to jump between stacks.
#ifdef _FORTIFY_SOURCE
#undef _FORTIFY_SOURCE
#endif
#include <setjmp.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <algorithm>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static

inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace emu {
struct Fiber {
  ucontext_t ctx;  // only to start the fiber
  jmp_buf jb;      // where it waits
  bool started = false;
  uint3 tid;
  bool done = false;
  char* stack = nullptr;
};
struct Bar { int live = 0, arrived = 0; long gen = 0; };
inline ucontext_t sched;
inline jmp_buf sched_jb;
inline std::vector<Fiber> fibers;
inline int current = 0;
inline Bar cta;
inline std::vector<Bar> warps;
inline std::vector<uint64_t> slots;
inline std::vector<unsigned char> dyn_smem;
inline std::function<void()> body;
inline long switches = 0;
inline long progress = 0;  // arrivals, releases and exits: a round without any is a deadlock

// One thread's asynchronous copies: committed groups, oldest first, and the
// copies issued since the last commit.
struct AsyncCopyJob { void* dst; const void* src; int bytes; };
struct AsyncQueue {
  std::vector<std::vector<AsyncCopyJob>> committed;
  std::vector<AsyncCopyJob> open;
};
inline std::vector<AsyncQueue> async_queues;

inline void* DynSmem() { return dyn_smem.data(); }
inline int Linear() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline void Yield() {
  ++switches;
  if (!_setjmp(fibers[current].jb)) _longjmp(sched_jb, 1);
}
inline void Release(Bar& b) { b.arrived = 0; ++b.gen; ++progress; }
inline void Arrive(Bar& b) {
  const long gen = b.gen;
  ++progress;
  if (++b.arrived == b.live) { Release(b); return; }
  while (b.gen == gen) Yield();
}
inline void Trampoline() {
  body();
  Fiber& f = fibers[current];
  f.done = true;
  ++progress;
  const int t = Linear();
  Bar& w = warps[t / 32];
  if (--cta.live > 0 && cta.arrived == cta.live) Release(cta);
  if (--w.live > 0 && w.arrived == w.live) Release(w);
  _longjmp(sched_jb, 1);
}
constexpr size_t kStack = 256 * 1024;
template <typename Fn>
void Launch(dim3 grid, dim3 block, size_t smem, Fn fn) {
  gridDim = grid;
  blockDim = block;
  body = fn;
  const int n = block.x * block.y * block.z;
  static std::vector<char*> stacks;
  while ((int)stacks.size() < n) stacks.push_back(static_cast<char*>(malloc(kStack)));
  for (unsigned bz = 0; bz < grid.z; ++bz)
  for (unsigned by = 0; by < grid.y; ++by)
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    blockIdx = make_uint3(bx, by, bz);
    dyn_smem.assign(smem + 16, 0xFF);
    fibers.assign(n, Fiber{});
    slots.assign(n, 0);
    async_queues.assign(n, AsyncQueue{});
    cta = Bar{n, 0, 0};
    warps.assign((n + 31) / 32, Bar{});
    for (int t = 0; t < n; ++t) warps[t / 32].live++;
    for (int t = 0; t < n; ++t) {
      Fiber& f = fibers[t];
      f.tid = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      f.stack = stacks[t];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack;
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, Trampoline, 0);
    }
    for (;;) {
      const long before = progress;
      bool any = false;
      static const bool reverse = getenv("EMU_REVERSE") != nullptr;
      for (int k = 0; k < n; ++k) {
        const int t = reverse ? n - 1 - k : k;
        if (fibers[t].done) continue;
        any = true;
        current = t;
        threadIdx = fibers[t].tid;
        if (!_setjmp(sched_jb)) {
          if (!fibers[t].started) {
            fibers[t].started = true;
            setcontext(&fibers[t].ctx);
          }
          _longjmp(fibers[t].jb, 1);
        }
      }
      if (!any) break;
      if (progress == before) {  // every live thread waits at a barrier no one else reaches
        fprintf(stderr, "emu: deadlock in CTA (%u,%u,%u): threads wait at barriers forever\n", bx, by, bz);
        abort();
      }
    }
  }
}
}  // namespace emu

inline void __syncthreads() { emu::Arrive(emu::cta); }
template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  static_assert(sizeof(T) <= 8);
  const int t = emu::Linear(), w = t / 32;
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  emu::slots[t] = bits;
  emu::Arrive(emu::warps[w]);
  T r;
  memcpy(&r, &emu::slots[w * 32 + ((t % 32) ^ mask)], sizeof(T));
  emu::Arrive(emu::warps[w]);
  return r;
}
namespace emu {
inline void AsyncCopy(void* dst, const void* src, int bytes) {
  // cp.async's rules: 16-byte-aligned addresses on both sides, 0..16 bytes read.
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      bytes < 0 || bytes > 16) {
    fprintf(stderr, "emu: AsyncCopy(dst %p, src %p, %d bytes) breaks cp.async's alignment or size\n",
            dst, src, bytes);
    abort();
  }
  memset(dst, 0xFF, 16);
  async_queues[Linear()].open.push_back({dst, src, bytes});
}
inline void AsyncCommit() {
  AsyncQueue& q = async_queues[Linear()];
  q.committed.push_back(std::move(q.open));
  q.open.clear();
}
inline void AsyncWait(int pending) {
  AsyncQueue& q = async_queues[Linear()];
  while (static_cast<int>(q.committed.size()) > pending) {
    for (const AsyncCopyJob& job : q.committed.front()) {
      memset(job.dst, 0, 16);
      memcpy(job.dst, job.src, job.bytes);
    }
    q.committed.erase(q.committed.begin());
  }
}
}  // namespace emu
template <typename T> T __ldcg(const T* p) { return *p; }
template <typename T> T __ldcs(const T* p) { return *p; }
template <typename T> void __stcs(T* p, T v) { *p = v; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, 4); return x; }
inline double __longlong_as_double(long long x) { double f; memcpy(&f, &x, 8); return f; }
inline long long __double_as_longlong(double f) { long long x; memcpy(&x, &f, 8); return x; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
