// Runs every GPU kernel once on small inputs under the SIMT emulator, without torch, and prints a
// checksum of each one's outputs.
//
// Built twice by CMake (CMakeLists.txt): with fibers, and with one OS thread per GPU thread
// (-DSIMT_EMU_THREADS) under ThreadSanitizer, which reports a missing __syncthreads or an
// unsynchronised shared-memory update as a data race. CTest fails on any report, and checks that
// both builds print the same checksums. `--planted-race` runs a kernel with a missing barrier
// instead: the negative control that shows the sanitizer sees such races; `--skipped-barrier` a
// kernel whose barrier some threads skip, which the emulator itself must catch.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/kernels/compact_kv.cuh"
#include "cuda/kernels/merge_attention_states.cuh"
#include "cuda/kernels/tree_attention.cuh"

namespace {

using namespace jakiro;
using namespace jakiro::gpu;

// Deterministic inputs: a 64-bit LCG mapped to [-1, 1).
struct Random {
  uint64_t state;
  float next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(state >> 40) / static_cast<float>(1ull << 23) - 1.f;
  }
  template <typename T>
  std::vector<T> values(size_t n, float scale = 1.f) {
    std::vector<T> v(n);
    for (auto& x : v) x = from_float<T>(scale * next());
    return v;
  }
};

template <typename T>
uint64_t checksum(const std::vector<T>& v) {  // FNV-1a over the bytes
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

void report(const char* name, uint64_t h) { std::printf("%-28s %016llx\n", name, static_cast<unsigned long long>(h)); }

template <typename elem_t>
void attention(const char* name) {
  Random rng{1};
  const int64_t B = 2, T = 5, Hq = 4, Hkv = 2, D = 40, S = 80, splits = 3;
  auto q = rng.values<elem_t>(B * T * Hq * D);
  auto k = rng.values<elem_t>(B * Hkv * S * D), v = rng.values<elem_t>(B * Hkv * S * D);
  std::vector<int64_t> lens{50, 0};
  // Tree 0 <- 1, 0 <- 2, 1 <- 3, 1 <- 4: node i sees its ancestors and itself.
  std::vector<int64_t> mask{0b1, 0b11, 0b101, 0b1011, 0b10011};
  mask.insert(mask.end(), mask.begin(), mask.end());
  std::vector<float> out_p(B * T * Hq * splits * D), lse_p(B * T * Hq * splits);
  const TreeAttentionParams<elem_t> p{q.data(), k.data(), v.data(), lens.data(), mask.data(), out_p.data(), lse_p.data(),
                                 B, T, Hq, Hkv, D, splits, 1, Hkv * S * D, S * D, 0.15f};
  launch_tree_attention_partial(p, nullptr);
  std::vector<elem_t> out(B * T * Hq * D);
  std::vector<float> lse(B * T * Hq);
  launch_merge_attention_states<elem_t>(MergeParams{out_p.data(), lse_p.data(), out.data(), lse.data(), B * T * Hq, splits, D},
                                   nullptr);
  report(name, checksum(out_p) ^ checksum(lse_p) ^ checksum(out) ^ checksum(lse));
}

void compaction() {
  Random rng{2};
  const int64_t B = 2, H = 3, S = 30, D = 12;
  auto cache = rng.values<float>(B * H * S * D);
  std::vector<int64_t> lens{4, 10}, path{0, 2, 3, 7, 0, 1, 5, -1}, path_len{4, 3};
  launch_compact_kv(CompactKvParams{cache.data(), lens.data(), path.data(), path_len.data(), B * H, B, H, S,
                                    D * static_cast<int64_t>(sizeof(float)), 4},
                    nullptr);
  report("compact_kv", checksum(cache));
}

// The negative control: a block sum in shared memory whose barrier between the writes and the
// reads is missing.
__global__ void planted_race_kernel(float* out) {
  __shared__ float partial[256];
  partial[threadIdx.x] = static_cast<float>(threadIdx.x);
  float s = 0.f;  // missing: __syncthreads();
  for (unsigned i = 0; i < blockDim.x; ++i) s += partial[i];
  if (threadIdx.x == 0) *out = s;
}

// The emulator's own check: thread 0 leaves before the barrier the others wait at.
__global__ void skipped_barrier_kernel(float* out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  if (threadIdx.x == 1) *out = 1.f;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--planted-race") == 0) {
    float out = 0.f;
    JAKIRO_LAUNCH(1, 64, 0, nullptr, planted_race_kernel)(&out);
    std::printf("planted race ran: %g\n", out);
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "--skipped-barrier") == 0) {
    float out = 0.f;
    JAKIRO_LAUNCH(1, 64, 0, nullptr, skipped_barrier_kernel)(&out);
    return 0;
  }
  std::printf("warp width %d\n", kWarp);
  attention<float>("tree_attention float32");
  attention<bf16>("tree_attention bfloat16");
  compaction();
  return 0;
}
