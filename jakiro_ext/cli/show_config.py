"""``python -m jakiro_ext show-config`` and ``ops-demo``: what was built and loaded, and every
fused op on SmolLM2-135M shapes against its reference."""
from __future__ import annotations

import time

import torch

from jakiro_ext import ops
from jakiro_ext.ops import reference


def show_config() -> int:

    print(f"jakiro_ext {__import__('jakiro_ext').__version__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), threads {torch.get_num_threads()}")
    if ops.compiled_available():
        print(f"compiled ops: loaded, built against torch {ops._C.torch_version}, "
              f"CUDA kernels {'built' if ops._C.with_cuda else 'not built'}")
        print(f"CPU float32 products: {'512-bit (AVX-512)' if ops.cpu_avx512() else '256-bit'}; bf16 products: "
              f"{'native bf16 dot instructions (AVX512-BF16)' if ops.cpu_bf16_dot() else 'widened to float32'}; "
              f"a prompt's float32 projections: {'oneDNN' if ops.cpu_onednn() else 'ATen (BLAS)'}; "
              f"weights read as measured best on: {ops.cpu_weight_stream()}")
        for name in ops.OP_NAMES:
            keys = [k for k in ("CPU", "CUDA") if torch._C._dispatch_has_kernel_for_dispatch_key(f"jakiro::{name}", k)]
            print(f"  jakiro::{name}: {', '.join(keys)}")
    else:
        print(f"compiled ops: NOT loaded: {ops.LOAD_ERROR}")
        return 1
    return 0


def _time(fn, reps=10):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def ops_demo() -> int:
    """One draft-verify step's worth of ops on SmolLM2-135M shapes, each compared with its
    reference (failing on a float32 difference above 1e-3) and timed."""
    if show_config():
        return 1
    g = torch.Generator().manual_seed(0)
    H, V, Hq, Hkv, D, T, prefix = 576, 49152, 9, 3, 64, 60, 2048
    print(f"\nSmolLM2-135M shapes: hidden {H}, vocab {V}, heads {Hq}/{Hkv}x{D}; tree of {T} nodes over a {prefix}-token prefix")

    parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, T)]])  # a binary tree, depth 5
    mask = ops.build_tree_mask(parents)
    q = torch.randn(1, T, Hq, D, generator=g)
    k = torch.randn(1, Hkv, prefix + T, D, generator=g)
    v = torch.randn(1, Hkv, prefix + T, D, generator=g)
    lens = torch.tensor([prefix])
    x = torch.randn(10, H, generator=g)
    moe_w = (torch.randn(10, H, generator=g) * H**-0.5, torch.randn(8, H, H, generator=g) * H**-0.5,
             torch.randn(8, H, H, generator=g) * H**-0.5, torch.randn(8, H, H, generator=g) * H**-0.5)
    lm_head = torch.randn(V, H, generator=g) * H**-0.5
    mlp_w = (torch.randn(2, H, 2 * H, generator=g) * (2 * H) ** -0.5, torch.randn(2, H, generator=g) * 0.1,
             torch.randn(2, 5, H, H, generator=g) * H**-0.5, torch.randn(2, 5, H, generator=g) * 0.1)
    leaves = torch.randn(10, 2 * H, generator=g)
    logits = torch.randn(1, T, V, generator=g)
    tokens = logits.argmax(-1).gather(1, parents.clamp_min(0))  # the target agrees everywhere
    cache = torch.randn(30, 2, 1, Hkv, prefix + T, D, generator=g)
    path, n = torch.tensor([[0, 1, 3, 7]]), torch.tensor([4])

    compacted = [cache.clone(), cache.clone()]  # compared once on copies; timed in place
    ops.compact_kv(compacted[0], lens, path, n)
    reference.compact_kv(compacted[1], lens, path, n)

    moe_out = ops.moe_top2(x, *moe_w)
    cases = [  # name, kernel, reference, (outputs to compare, when not the calls' results)
        ("tree_attention", lambda: ops.tree_attention(q, k, v, lens, mask),
         lambda: reference.tree_attention(q, k, v, lens, mask)),
        ("moe_top2 (10 tokens, 8 experts)", lambda: ops.moe_top2(x, *moe_w), lambda: reference.moe_top2(x, *moe_w)),
        ("contrastive_topk (10 rows, k=10)",
         lambda: ops.contrastive_topk(moe_out[1][:, 0], moe_out[1][:, 1], moe_out[4], lm_head, 10),
         lambda: reference.contrastive_topk(moe_out[1][:, 0], moe_out[1][:, 1], moe_out[4], lm_head, 10)),
        ("mlp_heads (10 leaves, 2 heads x 5)", lambda: ops.mlp_heads(leaves, *mlp_w),
         lambda: reference.mlp_heads(leaves, *mlp_w)),
        ("verify_tree (greedy)", lambda: ops.verify_tree(parents, tokens, logits),
         lambda: reference.verify_tree(parents, tokens, logits)),
        ("compact_kv (30 layers)", lambda: ops.compact_kv(cache, lens, path, n),
         lambda: reference.compact_kv(cache, lens, path, n), ((compacted[0],), (compacted[1],))),
    ]
    print(f"\n{'op':36s} {'max |diff|':>11s} {'kernel ms':>10s} {'reference ms':>13s} {'speedup':>8s}")
    worst = 0.0
    for name, ours, ref, *outputs in cases:
        got, want = outputs[0] if outputs else (ours(), ref())
        diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, want))
        worst = max(worst, diff)
        t_ours, t_ref = _time(ours), _time(ref, reps=3)
        print(f"{name:36s} {diff:11.2e} {t_ours:10.3f} {t_ref:13.3f} {t_ref / t_ours:7.1f}x")
    path_out, accept, bonus = ops.verify_tree(parents, tokens, logits)
    print(f"\nverify_tree accepted {int(accept[0])} draft tokens along nodes {path_out[0, :int(accept[0]) + 1].tolist()}, "
          f"bonus token {int(bonus[0])}")
    if worst > 1e-3:  # float32 everywhere here: a larger difference is a bug
        print(f"FAILED: an op differs from its reference by {worst:.3g}")
        return 1
    return 0
