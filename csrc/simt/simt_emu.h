// SIMT emulator: runs portable CUDA C++ kernels on the CPU, for tests on machines without a GPU.
//
// Compile the same kernel source with `g++ -std=c++20 -DSIMT_EMU` (csrc/cuda/device.h includes
// this header then). What it provides:
//   * threadIdx / blockIdx (thread-local), blockDim / gridDim, dim3, warpSize;
//   * `__shared__` as function-local static storage: blocks run one after another, the threads
//     of a block concurrently, so every thread of the running block sees the same variable;
//   * dynamic shared memory (SIMT_DYNAMIC_SHARED / device.h's JAKIRO_DYNAMIC_SMEM), filled with
//     0xff bytes (NaN floats) before each block so that reads of unwritten shared memory show;
//   * __syncthreads / __syncwarp as barriers; __shfl*_sync through a per-warp exchange buffer
//     between two warp barriers; atomics through std::atomic_ref;
//   * kernel launch via simt::launcher(kernel, grid, block, shared_bytes)(args...) (device.h's
//     JAKIRO_LAUNCH), synchronous.
// Two ways to run the threads of a block:
//   * default: cooperative fibers on the calling thread, switched only at barriers and shuffles:
//     deterministic and fast, for the normal tests;
//   * -DSIMT_EMU_THREADS: one OS thread per CUDA thread of a block (kept for the next blocks).
//     Built with -fsanitize=thread, a missing __syncthreads or a non-atomic shared update is
//     reported as a data race, which result comparisons alone can miss (csrc/simt/race_check.cpp).
// Errors that a GPU would turn into hangs or undefined behaviour end the process with a message: a barrier
// or shuffle that some threads of the block (warp) never reach, blocks over 1024 threads,
// shared memory requests over 228 KiB.
// Limits: warp-synchronous code must name full warps (masks other than all lanes are not
// emulated); tensor cores only through the WMMA subset at the end of this file (16x16x16, bf16
// into float); no PTX, async copies, cooperative groups or grid-wide sync; no
// independent forward progress between blocks (a block that waits for another block deadlocks);
// no memory model beyond "barriers and atomics order everything" (weaker GPU orderings that a
// kernel might wrongly rely on are not reproduced); `__shared__` variables keep their values from
// the previous block instead of being undefined.
#pragma once

#if !defined(SIMT_EMU)
#error "simt_emu.h is the CPU emulation of CUDA; compile with -DSIMT_EMU"
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef SIMT_WARP_SIZE
#define SIMT_WARP_SIZE 32
#endif
static_assert(SIMT_WARP_SIZE == 32 || SIMT_WARP_SIZE == 64, "SIMT_WARP_SIZE must be 32 or 64");

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = struct simt_stream*;

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = SIMT_WARP_SIZE;

namespace simt {

// Ends the process with status 70: a GPU would hang or be undefined here, and the fibers or
// threads of the block cannot be unwound.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "SIMT emulator: %s\n", what);
  std::fflush(nullptr);
  std::_Exit(70);
}

constexpr size_t kMaxSharedBytes = 228 * 1024;

// ----------------------------------------------------------------------------- fibers
#if !defined(SIMT_EMU_THREADS)
#if !defined(__x86_64__)
#error "the fiber mode of the SIMT emulator switches stacks with x86-64 code; use -DSIMT_EMU_THREADS elsewhere"
#endif

// Saves the callee-saved registers on the current stack, stores its pointer in *save and
// continues on the stack `next` (prepared by a previous switch or by Fiber::start).
__attribute__((naked, noinline)) inline void switch_stack(void** /*save*/, void* /*next*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

struct Scheduler;
inline Scheduler* g_scheduler = nullptr;

// The threads of one block as fibers on the calling thread. A fiber runs until it waits at a
// barrier, then control passes straight to the next unfinished fiber (round robin).
struct Scheduler {
  static constexpr size_t kStackBytes = 256 * 1024;
  std::vector<std::vector<unsigned char>> stacks;  // kept across blocks and launches
  std::vector<void*> sp;
  std::vector<char> done;
  void* main_sp = nullptr;
  dim3 dims;
  int nthreads = 0, current = 0, live = 0;
  uint64_t progress = 0, seen = 0;  // barrier arrivals and exits; more switches than threads without one: deadlock
  int idle_switches = 0;
  const std::function<void()>* body = nullptr;

  void switch_to(int next) {
    const int prev = current;
    current = next;
    threadIdx = dim3(next % dims.x, (next / dims.x) % dims.y, next / (dims.x * dims.y));
    switch_stack(&sp[prev], sp[next]);
  }

  int next_unfinished() const {
    int next = current;
    do next = (next + 1) % nthreads;
    while (done[next]);
    return next;
  }

  static void entry() {
    Scheduler& s = *g_scheduler;
    (*s.body)();
    s.done[s.current] = 1;
    ++s.progress;
    if (--s.live == 0) switch_stack(&s.sp[s.current], s.main_sp);
    s.switch_to(s.next_unfinished());
    __builtin_unreachable();
  }

  void run_block(int threads, const dim3& block_dims, const std::function<void()>& fn) {
    if (static_cast<int>(stacks.size()) < threads) stacks.resize(threads);
    nthreads = threads;
    dims = block_dims;
    sp.assign(threads, nullptr);
    done.assign(threads, 0);
    body = &fn;
    live = threads;
    idle_switches = 0;
    seen = progress;
    for (int t = 0; t < threads; ++t) {
      auto& stack = stacks[t];
      if (stack.empty()) stack.resize(kStackBytes);
      // Initial frame: six zeroed callee-saved registers, then `entry` as the return address,
      // aligned so that entry starts like a called function ((rsp + 8) % 16 == 0).
      auto top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t{15};
      auto* frame = reinterpret_cast<void**>(top) - 8;
      for (int i = 0; i < 6; ++i) frame[i] = nullptr;
      frame[6] = reinterpret_cast<void*>(&Scheduler::entry);
      frame[7] = nullptr;
      sp[t] = frame;
    }
    Scheduler* outer = g_scheduler;
    g_scheduler = this;
    current = 0;
    threadIdx = dim3(0, 0, 0);
    switch_stack(&main_sp, sp[0]);  // returns when the last fiber finishes
    g_scheduler = outer;
  }

  // The current fiber waits: run the next one.
  void yield() {
    if (progress != seen) {
      seen = progress;
      idle_switches = 0;
    } else if (++idle_switches > nthreads) {
      fail("deadlock: the threads of a block wait at different barriers (a __syncthreads or shuffle "
           "not reached by every thread of the block or warp)");
    }
    switch_to(next_unfinished());
  }
};

inline Scheduler& scheduler() {
  static Scheduler s;
  return s;
}

// A barrier for `expected` fibers; `exited` counts members that finished (they never arrive).
struct Barrier {
  int expected = 0, count = 0, exited = 0;
  uint64_t generation = 0;

  void reset(int members) {
    expected = members;
    count = exited = 0;
  }
  void member_exited() { ++exited; }

  void arrive_and_wait() {
    Scheduler& s = *g_scheduler;
    ++s.progress;
    if (++count == expected) {
      count = 0;
      ++generation;
      return;
    }
    const uint64_t g = generation;
    while (generation == g) {
      if (exited > 0) fail("a barrier or shuffle is waited at by some threads while others of its block/warp have exited");
      s.yield();
    }
  }
};

#else  // ----------------------------------------------------------------- real threads

// Each barrier (the block's, each warp's) has its own lock: a lock shared by all would order
// every warp's shuffles against every other warp's, and hide races between warps from TSan.
struct Barrier {
  int expected = 0, count = 0, exited = 0;  // guarded by `mutex`
  uint64_t generation = 0;
  std::mutex mutex;
  std::condition_variable cv;

  void reset(int members) {
    std::lock_guard<std::mutex> lock(mutex);
    expected = members;
    count = exited = 0;
  }
  void member_exited() {
    std::lock_guard<std::mutex> lock(mutex);
    ++exited;
    cv.notify_all();
  }

  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex);
    if (++count == expected) {
      count = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const uint64_t g = generation;
    while (generation == g) {
      if (exited > 0) fail("a barrier or shuffle is waited at by some threads while others of its block/warp have exited");
      if (cv.wait_for(lock, std::chrono::seconds(600)) == std::cv_status::timeout && generation == g)
        fail("deadlock: a barrier was not reached by every thread of its block/warp within 600 s");
    }
  }
};
#endif

// The generation of a barrier the caller is about to arrive at (it cannot change before then).
inline uint64_t barrier_generation(Barrier& b) {
#if defined(SIMT_EMU_THREADS)
  std::lock_guard<std::mutex> lock(b.mutex);
#endif
  return b.generation;
}

// ----------------------------------------------------------------------------- block state
struct Block {
  int nthreads = 0, nwarps = 0;
  Barrier block_barrier;
  std::unique_ptr<Barrier[]> warp_barriers;  // barriers do not move (their locks)
  int warp_capacity = 0;
  std::vector<uint64_t> exchange;  // two shuffle slots per thread
  std::vector<unsigned char> shared;

  void reset(int threads, size_t shared_bytes) {
    nthreads = threads;
    nwarps = (threads + SIMT_WARP_SIZE - 1) / SIMT_WARP_SIZE;
    block_barrier.reset(threads);
    if (nwarps > warp_capacity) {
      warp_barriers = std::make_unique<Barrier[]>(nwarps);
      warp_capacity = nwarps;
    }
    for (int w = 0; w < nwarps; ++w) warp_barriers[w].reset(std::min(SIMT_WARP_SIZE, threads - w * SIMT_WARP_SIZE));
    exchange.assign(2 * threads, 0);
    shared.assign(shared_bytes, 0xff);
  }

  void thread_exited(int t) {
    block_barrier.member_exited();
    warp_barriers[t / SIMT_WARP_SIZE].member_exited();
  }
};

inline Block& block() {
  static Block b;
  return b;
}

inline int linear_thread_index() {
  return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}

inline void* dynamic_shared_memory() { return block().shared.data(); }

#if defined(SIMT_EMU_THREADS)
// The OS threads that run a block's CUDA threads, kept across blocks and launches (one made per
// CUDA thread of every block was most of the race check's time under ThreadSanitizer). The pool
// must order no worker's body before another's, which would hide a race between them: each
// worker has a lock the launching thread takes only to hand it a task (all tasks are handed out
// before it waits for any), and another it waits at for the worker's end, which the worker takes
// only after its body. So, as with threads made and joined, the launch happens before every body
// and every body before the launch's end, and nothing else.
class Workers {
 public:
  void run(int threads, const std::function<void(int)>& body) {
    while (static_cast<int>(workers_.size()) < threads)
      workers_.push_back(std::make_unique<Worker>(static_cast<int>(workers_.size())));
    for (int t = 0; t < threads; ++t) workers_[t]->start(&body);
    for (int t = 0; t < threads; ++t) workers_[t]->wait();
  }

 private:
  struct Worker {
    std::mutex start_mutex, done_mutex;
    std::condition_variable started, done;
    const std::function<void(int)>* task = nullptr;  // guarded by start_mutex
    bool finished = false;                           // guarded by done_mutex
    explicit Worker(int index) { std::thread([this, index] { loop(index); }).detach(); }
    void start(const std::function<void(int)>* body) {
      std::lock_guard<std::mutex> lock(start_mutex);
      task = body;
      started.notify_one();
    }
    void wait() {
      std::unique_lock<std::mutex> lock(done_mutex);
      done.wait(lock, [this] { return finished; });
      finished = false;
    }
    [[noreturn]] void loop(int index) {
      for (;;) {
        const std::function<void(int)>* body;
        {
          std::unique_lock<std::mutex> lock(start_mutex);
          started.wait(lock, [this] { return task != nullptr; });
          body = std::exchange(task, nullptr);
        }
        (*body)(index);
        std::lock_guard<std::mutex> lock(done_mutex);
        finished = true;
        done.notify_one();
      }
    }
  };
  std::vector<std::unique_ptr<Worker>> workers_;
};

inline Workers& workers() {
  static Workers* pool = new Workers;  // never destroyed: its detached threads wait in it until the process ends
  return *pool;
}
#endif

inline void syncthreads() { block().block_barrier.arrive_and_wait(); }
inline void syncwarp() { block().warp_barriers[linear_thread_index() / SIMT_WARP_SIZE].arrive_and_wait(); }

// A shuffle: every lane publishes its value, the warp meets, each lane reads its source lane's
// slot. Two slot sets alternate with the warp barrier's generation: a lane can only write a set
// again after the next barrier, which every lane reaches only after reading that set.
template <typename T>
T shuffle(T value, int src_lane_in_warp) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "the SIMT emulator shuffles values of at most 8 bytes");
  Block& b = block();
  const int t = linear_thread_index();
  const int base = t - t % SIMT_WARP_SIZE;
  Barrier& barrier = b.warp_barriers[t / SIMT_WARP_SIZE];
  if (base + src_lane_in_warp >= b.nthreads) fail("a shuffle reads a lane beyond the block's last thread");
  uint64_t* slots = b.exchange.data() + (barrier_generation(barrier) & 1) * b.nthreads;
  std::memcpy(&slots[t], &value, sizeof(T));
  barrier.arrive_and_wait();
  T out;
  std::memcpy(&out, &slots[base + src_lane_in_warp], sizeof(T));
  return out;
}

// Runs the kernel body for every block of the grid, the threads of each block concurrently.
inline void run_grid(dim3 grid, dim3 block_dims, size_t shared_bytes, const std::function<void()>& body) {
  static std::mutex launch_mutex;  // one grid at a time: blocks share the static __shared__ storage
  std::lock_guard<std::mutex> guard(launch_mutex);
  const long threads = static_cast<long>(block_dims.x) * block_dims.y * block_dims.z;
  if (threads < 1 || threads > 1024) fail("a block must have 1 to 1024 threads");
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535)
    fail("grid dimensions must be >= 1, and y and z <= 65535 (CUDA rejects such launches)");
  if (shared_bytes > kMaxSharedBytes) fail("dynamic shared memory over 228 KiB per block");
  gridDim = grid;
  blockDim = block_dims;
  Block& b = block();
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.reset(static_cast<int>(threads), shared_bytes);
        const dim3 block_index(x, y, z);
#if defined(SIMT_EMU_THREADS)
        const std::function<void(int)> thread_body = [&](int t) {
          blockIdx = block_index;
          threadIdx = dim3(t % block_dims.x, (t / block_dims.x) % block_dims.y, t / (block_dims.x * block_dims.y));
          body();
          b.thread_exited(t);
        };
        workers().run(static_cast<int>(threads), thread_body);
#else
        blockIdx = block_index;
        std::function<void()> fiber_body = [&] {
          body();
          b.thread_exited(linear_thread_index());
        };
        scheduler().run_block(static_cast<int>(threads), block_dims, fiber_body);
#endif
      }
}

// simt::launcher(kernel, grid, block, shared_bytes)(args...): the arguments are converted to the
// kernel's parameter types once, like a CUDA launch copies them, and the grid runs to completion.
template <typename... Params>
auto launcher(void (*kernel)(Params...), dim3 grid, dim3 block_dims, size_t shared_bytes) {
  return [=](auto&&... args) {
    std::tuple<std::decay_t<Params>...> params(args...);
    run_grid(grid, block_dims, shared_bytes, [&] { std::apply(kernel, params); });
  };
}

}  // namespace simt

// ----------------------------------------------------------------------------- CUDA API
inline void __syncthreads() { simt::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { simt::syncwarp(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
T __shfl_sync(unsigned, T v, int src_lane, int width = SIMT_WARP_SIZE) {
  const int lane = simt::linear_thread_index() % SIMT_WARP_SIZE;
  return simt::shuffle(v, lane - lane % width + src_lane % width);
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = SIMT_WARP_SIZE) {
  const int lane = simt::linear_thread_index() % SIMT_WARP_SIZE;
  const int src = lane ^ lane_mask;
  return simt::shuffle(v, src < (lane / width + 1) * width ? src : lane);
}
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = SIMT_WARP_SIZE) {
  const int lane = simt::linear_thread_index() % SIMT_WARP_SIZE;
  const int src = lane + static_cast<int>(delta);
  return simt::shuffle(v, src < (lane / width + 1) * width ? src : lane);
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = SIMT_WARP_SIZE) {
  const int lane = simt::linear_thread_index() % SIMT_WARP_SIZE;
  const int src = lane - static_cast<int>(delta);
  return simt::shuffle(v, src >= lane - lane % width ? src : lane);
}

template <typename T>
T atomicAdd(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_add(value);
}
template <typename T>
T atomicSub(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_sub(value);
}
template <typename T>
T atomicOr(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_or(value);
}
template <typename T>
T atomicExch(T* address, T value) {
  return std::atomic_ref<T>(*address).exchange(value);
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;
}
template <typename T>
T atomicMax(T* address, T value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (old < value && !ref.compare_exchange_weak(old, value)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* address, T value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (value < old && !ref.compare_exchange_weak(old, value)) {
  }
  return old;
}

#define SIMT_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::simt::dynamic_shared_memory())

// ----------------------------------------------------------------------------- WMMA (tensor cores)
// nvcuda::wmma's 16x16x16 bf16 -> float subset, as the tensor-core kernels use it. The API hides
// which lane holds which element of a fragment. Here a fragment is the whole tile, row-major
// (x[r * cols + c], num_elements = 256): a load or fill sets all of it in every lane, while an
// accumulator's element e belongs to lane e % warp, which alone computes it in mma_sync and
// writes it in store_matrix_sync (the other elements of its copy are stale: element-wise code over
// x[0 .. num_elements) is fine, as on a GPU, as long as only the API moves elements between lanes).
// What a GPU does and is reproduced: a load reads memory as it is when the lane gets there
// (shared memory written by other lanes needs a __syncwarp first: fibers switch only at barriers,
// so a missing one reads stale data or the NaN fill), and reading another lane's stored elements
// needs a __syncwarp too. Products of bf16 are exact in float; the sums run in float in k order
// (tensor cores round differently: tests compare with tolerances).
struct __nv_bfloat16 {
  uint16_t bits;
};

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the SIMT emulator's WMMA has the 16x16x16 shape only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float> : std::is_same_v<T, __nv_bfloat16>,
                "the SIMT emulator's WMMA multiplies bf16 tiles into float accumulators only");
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = rows * cols;
  T x[num_elements];
};

namespace detail {
inline float to_float(__nv_bfloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(float v) { return v; }

template <typename Frag, typename T>
void load(Frag& f, const T* p, unsigned ldm, bool col_major) {
  for (int r = 0; r < Frag::rows; ++r)
    for (int c = 0; c < Frag::cols; ++c) f.x[r * Frag::cols + c] = col_major ? p[c * ldm + r] : p[r * ldm + c];
}
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T value) {
  for (auto& v : f.x) v = value;
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Layout, void>, "a matrix_a or matrix_b fragment names its layout");
  detail::load(f, p, ldm, std::is_same_v<Layout, col_major>);
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm, layout_t layout) {
  detail::load(f, p, ldm, layout == mem_col_major);
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout) {
  const int lane = ::simt::linear_thread_index() % SIMT_WARP_SIZE;
  for (int e = lane; e < M * N; e += SIMT_WARP_SIZE) {
    const int r = e / N, c = e % N;
    (layout == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]) = f.x[e];
  }
}

template <int M, int N, int K, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, __nv_bfloat16, LayoutA>& a,
              const fragment<matrix_b, M, N, K, __nv_bfloat16, LayoutB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  const int lane = ::simt::linear_thread_index() % SIMT_WARP_SIZE;
  for (int e = lane; e < M * N; e += SIMT_WARP_SIZE) {  // this lane's elements (d may alias c)
    const int m = e / N, n = e % N;
    float s = c.x[e];
    for (int k = 0; k < K; ++k) s += detail::to_float(a.x[m * K + k]) * detail::to_float(b.x[k * N + n]);
    d.x[e] = s;
  }
}

}  // namespace nvcuda::wmma
