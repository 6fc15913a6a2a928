"""Tree attention over a KV cache at decode shapes: jakiro::tree_attention (split-KV) against
PyTorch's SDPA with a materialised mask (the baseline an engine without the op would use) and
against the pure-PyTorch reference. Reports time, speedup and the KV read rate against the
machine's measured bandwidth."""
import math

import torch
import torch.nn.functional as F

from common import Table, max_abs_diff, memory_bandwidth_gbs, parse_args, timeit
from jakiro_ext import ops, reference


def sdpa_tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask):
    """Per sequence: expand the GQA heads, materialise the [T, L] boolean mask, call SDPA."""
    B, T, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    sees = reference.unpack_tree_mask(tree_mask, T)
    outs = []
    for b in range(B):
        L = int(prefix_lens[b]) + T
        mask = torch.cat([sees.new_ones(T, L - T), sees[b]], dim=1)
        k = k_cache[b, :, :L].repeat_interleave(G, dim=0)
        v = v_cache[b, :, :L].repeat_interleave(G, dim=0)
        outs.append(F.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1))
    return torch.stack(outs)


def main():
    args = parse_args(__doc__)
    table = Table("tree_attention", args)
    bw = memory_bandwidth_gbs(args.threads)
    models = {"smollm2-9/3x64": (9, 3, 64), "llama-32/8x128": (32, 8, 128)}
    prefixes = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    # The EAGLE-2 tree (60 tokens) on every prefix; then plain decoding (1 token) and a small
    # tree, where the kernel is bound by reading the cache rather than by arithmetic.
    cases = [(60, p) for p in prefixes] + [(1, 4096), (1, 8192), (4, 8192)]
    for model, (Hq, Hkv, D) in models.items():
        for dtype in (torch.float32, torch.bfloat16):
            for T, prefix in cases:
                g = torch.Generator().manual_seed(0)
                q = torch.randn(1, T, Hq, D, generator=g).to(dtype)
                k = torch.randn(1, Hkv, prefix + T, D, generator=g).to(dtype)
                v = torch.randn(1, Hkv, prefix + T, D, generator=g).to(dtype)
                parents = torch.tensor([[-1] + [max(0, i - 1 - (i % 7)) for i in range(1, T)]])
                mask = ops.build_tree_mask(parents)
                lens = torch.tensor([prefix])
                ours = lambda: ops.tree_attention(q, k, v, lens, mask)  # noqa: E731
                sdpa = lambda: sdpa_tree_attention(q, k, v, lens, mask)  # noqa: E731
                ref = lambda: reference.tree_attention(q, k, v, lens, mask)  # noqa: E731
                diff = max_abs_diff(ours()[0], ref()[0])
                t_ours, t_sdpa, t_ref = (timeit(f, args.reps) for f in (ours, sdpa, ref))
                kv_bytes = 2 * Hkv * (prefix + T) * D * k.element_size()
                gbs = kv_bytes / (t_ours["median_ms"] * 1e-3) / 1e9
                table.add(model=model, dtype=str(dtype).replace("torch.", ""), prefix=prefix, tree=T,
                          max_abs_diff=diff, ours_ms=t_ours["median_ms"], ours_p20_ms=t_ours["p20_ms"],
                          ours_p80_ms=t_ours["p80_ms"], sdpa_ms=t_sdpa["median_ms"], reference_ms=t_ref["median_ms"],
                          speedup_vs_sdpa=t_sdpa["median_ms"] / t_ours["median_ms"],
                          speedup_vs_reference=t_ref["median_ms"] / t_ours["median_ms"], kv_gbs=gbs,
                          bandwidth_fraction=gbs / bw,
                          gflops=4 * Hq * T * (prefix + T) * D / (t_ours["median_ms"] * 1e-3) / 1e9)
    table.save()


if __name__ == "__main__":
    main()
