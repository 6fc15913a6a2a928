"""Tree attention over a KV cache at decode shapes: jakiro::tree_attention (split-KV) against
PyTorch's SDPA with a materialised mask (the baseline an engine without the op would use) and
against the pure-PyTorch reference. Reports time, speedup and the KV read rate against the
machine's measured bandwidth; with --device cuda, against the GPU's rated HBM bandwidth (target
on an H100: >= 70% at long context) and against the same kernel unsplit (num_splits=1, what a
FlashInfer-style decode kernel without split-KV does: target, faster at small batch)."""

import torch
import torch.nn.functional as F

from common import Table, max_abs_diff, memory_bandwidth_gbs, on_device, parse_args, peak_hbm_gbs, timeit
from jakiro_ext import ops
from jakiro_ext.ops import reference


def sdpa_inputs(q, k_cache, v_cache, prefix_lens, tree_mask):
    """Per sequence, what SDPA takes: the query heads first, the KV heads expanded to the query
    heads (GQA), the [T, L] boolean mask materialised. Built once, outside the timing: an engine
    with SDPA keeps these between calls, so only the attention itself is its cost."""
    B, T, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    sees = reference.unpack_tree_mask(tree_mask, T)
    inputs = []
    for b in range(B):
        L = int(prefix_lens[b]) + T
        mask = torch.cat([sees.new_ones(T, L - T), sees[b]], dim=1)
        inputs.append((q[b].transpose(0, 1).contiguous(), k_cache[b, :, :L].repeat_interleave(G, dim=0),
                       v_cache[b, :, :L].repeat_interleave(G, dim=0), mask))
    return inputs


def sdpa_tree_attention(inputs):
    return [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for q, k, v, mask in inputs]


def main():
    args = parse_args(__doc__)
    table = Table("tree_attention", args)
    bw = memory_bandwidth_gbs(args.threads)
    gpu = args.device.type == "cuda"
    peak = peak_hbm_gbs() if gpu else bw
    models = {"smollm2-9/3x64": (9, 3, 64), "llama-32/8x128": (32, 8, 128)}
    if gpu:  # long contexts, where reading the cache dominates; split-KV against one split
        prefixes = [4096, 32768] if args.quick else [2048, 8192, 32768, 65536]
        batches, dtypes = (1, 4), (torch.bfloat16, torch.float32)
    else:
        prefixes = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
        batches, dtypes = (1,), (torch.float32, torch.bfloat16)
    # The EAGLE-2 tree (60 tokens) on every prefix; then plain decoding (1 token) and a small
    # tree, where the kernel is bound by reading the cache rather than by arithmetic.
    cases = [(60, p) for p in prefixes] + [(1, prefixes[-1]), (4, prefixes[-1])]
    for model, (Hq, Hkv, D) in models.items():
        for dtype in dtypes:
            for B in batches:
                for T, prefix in cases:
                    g = torch.Generator().manual_seed(0)
                    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
                    k = torch.randn(B, Hkv, prefix + T, D, generator=g).to(dtype)
                    v = torch.randn(B, Hkv, prefix + T, D, generator=g).to(dtype)
                    parents = torch.tensor([[-1] + [max(0, i - 1 - (i % 7)) for i in range(1, T)]] * B)
                    q, k, v, mask, lens = on_device(q, k, v, ops.build_tree_mask(parents), torch.tensor([prefix] * B))
                    ours = lambda: ops.tree_attention(q, k, v, lens, mask)  # noqa: E731
                    unsplit = lambda: ops.tree_attention(q, k, v, lens, mask, num_splits=1)  # noqa: E731
                    prepared = sdpa_inputs(q, k, v, lens, mask)
                    sdpa = lambda: sdpa_tree_attention(prepared)  # noqa: E731
                    ref = lambda: reference.tree_attention(q, k, v, lens, mask)  # noqa: E731
                    diff = max_abs_diff(ours()[0], ref()[0])
                    t_ours, t_unsplit, t_sdpa = (timeit(f, args.reps) for f in (ours, unsplit, sdpa))
                    # The Python reference is timed on the CPU only (on a GPU it is launch-bound).
                    t_ref = timeit(ref, max(3, args.reps // 5)) if not gpu else None
                    kv_bytes = 2 * B * Hkv * (prefix + T) * D * k.element_size()
                    gbs = kv_bytes / (t_ours["median_ms"] * 1e-3) / 1e9
                    row = dict(model=model, dtype=str(dtype).replace("torch.", ""), batch=B, prefix=prefix, tree=T,
                               max_abs_diff=diff, ours_ms=t_ours["median_ms"], ours_p20_ms=t_ours["p20_ms"],
                               ours_p80_ms=t_ours["p80_ms"], unsplit_ms=t_unsplit["median_ms"],
                               speedup_vs_unsplit=t_unsplit["median_ms"] / t_ours["median_ms"],
                               sdpa_ms=t_sdpa["median_ms"], speedup_vs_sdpa=t_sdpa["median_ms"] / t_ours["median_ms"])
                    if t_ref is not None:
                        row.update(reference_ms=t_ref["median_ms"],
                                   speedup_vs_reference=t_ref["median_ms"] / t_ours["median_ms"])
                    row.update(kv_gbs=gbs, bandwidth_fraction=gbs / peak,
                               gflops=4 * B * Hq * T * (prefix + T) * D / (t_ours["median_ms"] * 1e-3) / 1e9)
                    table.add(**row)
    table.save()


if __name__ == "__main__":
    main()
