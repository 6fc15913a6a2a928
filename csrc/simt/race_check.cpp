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
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda/kernels/compact_kv.cuh"
#include "cuda/kernels/contrastive_topk.cuh"
#include "cuda/kernels/dequantize_rows.cuh"
#include "cuda/kernels/linear.cuh"
#include "cuda/kernels/linear_wmma.cuh"
#include "cuda/kernels/mlp_heads.cuh"
#include "cuda/kernels/moe_top2.cuh"
#include "cuda/kernels/merge_attention_states.cuh"
#include "cuda/kernels/rms_norm.cuh"
#include "cuda/kernels/rope_kv_write.cuh"
#include "cuda/kernels/silu_mul.cuh"
#include "cuda/kernels/tree_attention.cuh"
#include "cuda/kernels/tree_attention_wmma.cuh"
#include "cuda/kernels/verify_tree.cuh"

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

int32_t device_errors = 0;  // the kernels' error word: stays 0 (every input is valid)

void report(const char* name, uint64_t h) { std::printf("%-28s %016llx\n", name, static_cast<unsigned long long>(h)); }

// split_len > 0: fixed splits of each row's run (a split past every run: the early exit).
template <typename elem_t>
void attention(const char* name, int64_t split_len) {
  Random rng{1};
  const int64_t B = 2, T = 5, Hq = 4, Hkv = 2, D = 40, S = 320, splits = 3;
  auto q = rng.values<elem_t>(B * T * Hq * D);
  auto k = rng.values<elem_t>(B * Hkv * S * D), v = rng.values<elem_t>(B * Hkv * S * D);
  std::vector<int64_t> lens{300, 0};  // 305 keys: every warp of a block gets some
  // Tree 0 <- 1, 0 <- 2, 1 <- 3, 1 <- 4: node i sees its ancestors and itself.
  std::vector<int64_t> mask{0b1, 0b11, 0b101, 0b1011, 0b10011};
  mask.insert(mask.end(), mask.begin(), mask.end());
  std::vector<float> out_p(B * T * Hq * splits * D), lse_p(B * T * Hq * splits);
  const TreeAttentionParams<elem_t> p{q.data(), k.data(), v.data(), lens.data(), mask.data(), out_p.data(), lse_p.data(),
                                 B, T, Hq, Hkv, D, splits, 1, Hkv * S * D, S * D, 0.15f, S, &device_errors, 0, split_len};
  launch_tree_attention_partial(p, nullptr);
  std::vector<elem_t> out(B * T * Hq * D);
  std::vector<float> lse(B * T * Hq);
  launch_merge_attention_states<elem_t>(MergeParams{out_p.data(), lse_p.data(), out.data(), lse.data(), B * T * Hq, splits, D},
                                   nullptr);
  report(name, checksum(out_p) ^ checksum(lse_p) ^ checksum(out) ^ checksum(lse));
}

// The tensor-core kernel (WMMA): bf16, 36 query rows per KV head (3 tiles), a NaN value in a tree
// node that some rows do not see (the element-wise fix-up path); with fixed splits, the near runs.
void attention_tensor_cores(const char* name, int64_t split_len) {
  Random rng{7};
  const int64_t B = 2, T = 9, Hq = 4, Hkv = 1, D = 32, S = 320, splits = 2;
  auto q = rng.values<bf16>(B * T * Hq * D);
  auto k = rng.values<bf16>(B * Hkv * S * D), v = rng.values<bf16>(B * Hkv * S * D);
  std::vector<int64_t> lens{300, 0};
  v[(300 + 2) * D + 5] = from_float<bf16>(std::numeric_limits<float>::quiet_NaN());
  std::vector<int64_t> mask(B * T);  // a binary tree: node i's parent is (i - 1) / 2
  for (int64_t i = 0; i < T; ++i) mask[i] = mask[T + i] = (i == 0 ? 0 : mask[(i - 1) / 2]) | (int64_t{1} << i);
  std::vector<float> out_p(B * T * Hq * splits * D), lse_p(B * T * Hq * splits);
  const TreeAttentionParams<bf16> p{q.data(), k.data(), v.data(), lens.data(), mask.data(), out_p.data(), lse_p.data(),
                                    B, T, Hq, Hkv, D, splits, 1, Hkv * S * D, S * D, 0.15f, S, &device_errors, 0,
                                    split_len};
  launch_tree_attention_partial_wmma(p, nullptr);
  report(name, checksum(out_p) ^ checksum(lse_p));
}

void compaction() {
  Random rng{2};
  const int64_t B = 2, H = 3, S = 30, D = 12;
  auto cache = rng.values<float>(B * H * S * D);
  std::vector<int64_t> lens{4, 10}, path{0, 2, 3, 7, 0, 1, 5, -1}, path_len{4, 3};
  launch_compact_kv(CompactKvParams{cache.data(), lens.data(), path.data(), path_len.data(), B * H, B, H, S,
                                    D * static_cast<int64_t>(sizeof(float)), 4, &device_errors},
                    nullptr);
  report("compact_kv", checksum(cache));
}

void dequantization() {
  Random rng{9};
  const int64_t groups = 2, blocks = 3, chunk = kQuantLanes * quant_block_bytes(QuantFormat::kQ4_1);
  std::vector<uint8_t> packed(groups * blocks * chunk);
  for (auto& b : packed) b = static_cast<uint8_t>(rng.next() * 60.f + 60.f);  // (float16 scales of moderate size)
  std::vector<int64_t> rows{0, 17, 31, 5};
  std::vector<float> out(rows.size() * blocks * kQuantBlock);
  launch_dequantize_rows(DequantizeRowsParams{packed.data(), rows.data(), out.data(), static_cast<int64_t>(rows.size()),
                                              groups, blocks, QuantFormat::kQ4_1, &device_errors},
                         nullptr);
  report("dequantize_rows Q4_1", checksum(out));
}

template <typename elem_t>
void linear(const char* name) {
  Random rng{3};
  const int64_t M = 5, K = 70, N = 37;
  auto x = rng.values<elem_t>(M * K), w = rng.values<elem_t>(N * K, 0.2f), bias = rng.values<elem_t>(N);
  std::vector<elem_t> y(M * N);
  launch_linear<elem_t>(LinearParams{x.data(), w.data(), bias.data(), y.data(), M, K, N, 0}, nullptr);
  report(name, checksum(y));
}

// The tensor-core linear with K split in two (its partial sums, then their sum) and two row tiles.
void linear_tensor_cores() {
  Random rng{13};
  const int64_t M = 20, K = 1048, N = 37, splits = tc_linear_splits(N, K);
  auto x = rng.values<bf16>(M * K), w = rng.values<bf16>(N * K, 0.05f), bias = rng.values<bf16>(N);
  std::vector<bf16> y(M * N);
  std::vector<float> partial(splits * M * N);
  launch_linear_wmma(TcLinearParams{x.data(), w.data(), bias.data(), y.data(), partial.data(), M, K, N, splits},
                     nullptr);
  if (splits != 2) {
    std::printf("error: linear_wmma: expected K split in 2, got %lld\n", static_cast<long long>(splits));
    std::exit(1);
  }
  report("linear bfloat16 tensor cores", checksum(y));
}

template <typename elem_t>
void mlp_heads(const char* name) {
  Random rng{4};
  const int64_t M = 5, K = 40, J = 2, H = 37, NB = 2;  // layers read a buffer the other layer wrote
  auto x = rng.values<elem_t>(M * K), w_in = rng.values<elem_t>(J * H * K, 0.2f), b_in = rng.values<elem_t>(J * H);
  auto w_blocks = rng.values<elem_t>(J * NB * H * H, 0.2f), b_blocks = rng.values<elem_t>(J * NB * H);
  std::vector<float> act(2 * J * M * H);
  std::vector<elem_t> out(M * J * H);
  launch_mlp_heads<elem_t>(MlpHeadsParams{x.data(), w_in.data(), b_in.data(), w_blocks.data(), b_blocks.data(),
                                          act.data(), out.data(), M, K, J, H, NB, 0},
                           nullptr);
  report(name, checksum(out));
}

template <typename elem_t>
void rms_norm(const char* name) {
  Random rng{7};
  const int64_t rows = 3, H = 300;  // H not a multiple of the block: idle threads in the reduction
  auto x = rng.values<elem_t>(rows * H), residual = rng.values<elem_t>(rows * H), w = rng.values<elem_t>(H);
  std::vector<elem_t> out(rows * H), sum(rows * H);
  launch_rms_norm<elem_t>(RmsNormParams{x.data(), residual.data(), w.data(), out.data(), sum.data(), rows, H, 1e-5f},
                          nullptr);
  report(name, checksum(out) ^ checksum(sum));
}

template <typename elem_t>
void silu_mul(const char* name) {
  Random rng{17};
  const int64_t rows = 3, I = 300;  // I not a multiple of the block: idle threads in the last stride
  auto gate_up = rng.values<elem_t>(rows * 2 * I);
  std::vector<elem_t> out(rows * I);
  launch_silu_mul<elem_t>(SiluMulParams{gate_up.data(), out.data(), rows, I}, nullptr);
  report(name, checksum(out));
}

template <typename elem_t>
void rope_kv(const char* name) {
  Random rng{8};
  const int64_t B = 2, T = 3, Hq = 3, Hkv = 1, D = 64, S = 8;  // 5 heads x 64 > the block: strided loop
  auto qkv = rng.values<elem_t>(B * T * (Hq + 2 * Hkv) * D), cos = rng.values<elem_t>(B * T * D),
       sin = rng.values<elem_t>(B * T * D);
  std::vector<elem_t> cache(2 * B * Hkv * S * D), q(B * T * Hq * D);
  std::vector<int64_t> lengths{2, 5};
  launch_rope_kv_write<elem_t>(RopeKvParams{qkv.data(), cos.data(), sin.data(), cache.data(), cache.data() + B * Hkv * S * D,
                                            lengths.data(), q.data(), B, T, Hq, Hkv, D, Hkv * S * D, S * D, S,
                                            &device_errors},
                               nullptr);
  report(name, checksum(q) ^ checksum(cache));
}

template <typename elem_t>
void moe(const char* name) {
  Random rng{4};
  const int64_t M = 6, H = 48, N = 4, I = 40;
  auto x = rng.values<elem_t>(M * H), router = rng.values<elem_t>((N + 2) * H, 0.3f);
  auto gate = rng.values<elem_t>(N * I * H, 0.2f), up = rng.values<elem_t>(N * I * H, 0.2f);
  auto down = rng.values<elem_t>(N * H * I, 0.2f);
  std::vector<elem_t> out(M * H), expert_out(M * 2 * H);
  std::vector<int64_t> idx(M * 2);
  std::vector<float> score(M * 2), contrast(M * 2), h(M * 2 * I);
  launch_moe_top2<elem_t>(MoeParams{x.data(), router.data(), gate.data(), up.data(), down.data(), out.data(),
                                    expert_out.data(), idx.data(), score.data(), contrast.data(), h.data(), M, H, N, I,
                                    false, 0, 0},
                          nullptr);
  report(name, checksum(out) ^ checksum(expert_out) ^ checksum(idx) ^ checksum(score) ^ checksum(contrast));
}

// Vocabulary 4200 with k = 20: the split path (slices of the vocabulary, then a merge).
template <typename elem_t>
void contrastive_head(const char* name) {
  Random rng{5};
  const int64_t rows = 2, H = 24, V = 4200, k = 20;
  const int64_t splits = contrastive::split_count(V, k);
  auto h_a = rng.values<elem_t>(rows * H), h_b = rng.values<elem_t>(rows * H);
  auto lm_head = rng.values<elem_t>(V * H);
  std::vector<float> weights{0.7f, 0.3f, 0.6f, 0.4f}, features(rows * H), logits(rows * V);
  std::vector<float> split_values(rows * splits * k), split_max(rows * splits), split_sum(rows * splits);
  std::vector<int64_t> split_indices(rows * splits * k), ids(rows * k);
  std::vector<float> logprobs(rows * k);
  launch_contrastive_topk<elem_t>(
      ContrastiveParams{h_a.data(), h_b.data(), weights.data(), lm_head.data(), features.data(), logits.data(),
                        logprobs.data(), ids.data(), rows, H, V, k, rows, splits, split_values.data(),
                        split_indices.data(), split_max.data(), split_sum.data()},
      nullptr);
  report(name, checksum(logprobs) ^ checksum(ids));
}

// A 12-node tree over a 2000-token vocabulary: greedy, then sampling with top-k and top-p.
void verification() {
  Random rng{6};
  const int64_t B = 2, T = 12, V = 2000;
  std::vector<int64_t> parents{-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 9}, tokens(B * T);
  parents.insert(parents.end(), parents.begin(), parents.end());
  for (auto& t : tokens) t = static_cast<int64_t>((rng.next() + 1.f) * 0.5f * (V - 1));
  auto logits = rng.values<float>(B * T * V, 4.f);
  for (int64_t b = 0; b < B; ++b)  // the target agrees with the first child everywhere: a deep walk
    for (int64_t c = 1; c < T; ++c) logits[(b * T + parents[b * T + c]) * V + tokens[b * T + c]] += 20.f;
  std::vector<double> uniforms(B * (T + 1));
  for (auto& u : uniforms) u = 0.5 * (rng.next() + 1.f);
  uint64_t h = 0;
  for (int mode = 0; mode < 3; ++mode) {
    std::vector<int64_t> path(B * T, -1), accept(B), bonus(B), choice(B * T);
    std::vector<double> weights(B * V);
    const double temperature = mode == 0 ? 0.0 : 0.8, top_p = mode == 2 ? 0.9 : 1.0;
    const int64_t top_k = mode == 1 ? 40 : 0;
    launch_verify_tree<float>(VerifyParams{parents.data(), tokens.data(), logits.data(), uniforms.data(), path.data(),
                                           accept.data(), bonus.data(), choice.data(), weights.data(), B, T, V,
                                           temperature, top_p, top_k, &device_errors},
                              nullptr);
    h ^= checksum(path) ^ checksum(accept) ^ checksum(bonus);
  }
  report("verify_tree", h);
}

// The negative control: a block sum in shared memory whose barrier between the writes and the
// reads is missing; the warps shuffle in between, which must not hide the race between warps.
__global__ void planted_race_kernel(float* out) {
  __shared__ float partial[256];
  partial[threadIdx.x] = static_cast<float>(threadIdx.x);
  const float lanes = warp_sum(1.f);  // missing: __syncthreads();
  float s = 0.f;
  for (unsigned i = 0; i < blockDim.x; ++i) s += partial[i];
  if (threadIdx.x == 0) *out = s + lanes;
}

// The emulator's own check: thread 0 leaves before the barrier the others wait at.
__global__ void skipped_barrier_kernel(float* out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  if (threadIdx.x == 1) *out = 1.f;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out at once, also when a later kernel aborts
  if (argc > 1 && std::strcmp(argv[1], "--planted-race") == 0) {
    float out = 0.f;
    JAKIRO_LAUNCH(1, 2 * kWarp, 0, nullptr, planted_race_kernel)(&out);
    std::printf("planted race ran: %g\n", out);
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "--skipped-barrier") == 0) {
    float out = 0.f;
    JAKIRO_LAUNCH(1, 64, 0, nullptr, skipped_barrier_kernel)(&out);
    return 0;
  }
  std::printf("warp width %d\n", kWarp);
  attention<float>("tree_attention float32", 0);
  attention<bf16>("tree_attention bfloat16", 0);
  attention<float>("tree_attention fixed splits", kFixedSplitLen);
  attention<bf16>("tree_attention bf16 fixed", kFixedSplitLen);
  attention_tensor_cores("tree_attention tensor cores", 0);
  attention_tensor_cores("tensor cores fixed splits", kFixedSplitLen);
  compaction();
  dequantization();
  linear<float>("linear float32");
  linear<bf16>("linear bfloat16");
  linear_tensor_cores();
  mlp_heads<float>("mlp_heads float32");
  mlp_heads<bf16>("mlp_heads bfloat16");
  rms_norm<float>("rms_norm float32");
  rms_norm<bf16>("rms_norm bfloat16");
  rope_kv<float>("rope_kv_write float32");
  rope_kv<bf16>("rope_kv_write bfloat16");
  silu_mul<float>("silu_mul float32");
  silu_mul<bf16>("silu_mul bfloat16");
  moe<float>("moe_top2 float32");
  moe<bf16>("moe_top2 bfloat16");
  contrastive_head<float>("contrastive_topk float32");
  contrastive_head<bf16>("contrastive_topk bfloat16");
  verification();
  if (device_errors != 0) {
    std::printf("error: the kernels reported bad inputs: %d\n", device_errors);
    return 1;
  }
  std::printf("done\n");
  return 0;
}
