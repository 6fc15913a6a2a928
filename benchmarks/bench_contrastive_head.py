"""The fused (contrastive) LM head with top-k at draft-step shapes: jakiro::contrastive_topk
against the eager reference (full logits, log_softmax, topk). Reports time, speedup and the
LM-head read rate."""
import torch

from common import Table, max_abs_diff, memory_bandwidth_gbs, on_device, parse_args, timeit
from jakiro_ext import ops
from jakiro_ext.ops import reference


def main():
    args = parse_args(__doc__)
    table = Table("contrastive_head", args)
    bw = memory_bandwidth_gbs(args.threads)
    H, V, k = 576, 49152, 10  # SmolLM2-135M
    for dtype in (torch.float32, torch.bfloat16):
        for contrastive in (False, True):
            for rows in ((1, 10) if args.quick else (1, 10, 20)):
                g = torch.Generator().manual_seed(0)
                h_a = torch.randn(rows, H, generator=g).to(dtype)
                h_b = torch.randn(rows, H, generator=g).to(dtype) if contrastive else None
                w = torch.tensor([[0.7, 0.3]]).expand(rows, 2).contiguous() if contrastive else None
                lm_head = (torch.randn(V, H, generator=g) * H**-0.5).to(dtype)
                h_a, lm_head = on_device(h_a, lm_head)
                h_b, w = (on_device(t) if t is not None else None for t in (h_b, w))
                ours = lambda: ops.contrastive_topk(h_a, h_b, w, lm_head, k)  # noqa: E731
                ref = lambda: reference.contrastive_topk(h_a, h_b, w, lm_head, k)  # noqa: E731
                diff = max_abs_diff(ours(), ref())
                t_ours, t_ref = timeit(ours, args.reps), timeit(ref, args.reps)
                gbs = lm_head.numel() * lm_head.element_size() / (t_ours["median_ms"] * 1e-3) / 1e9
                table.add(dtype=str(dtype).replace("torch.", ""), contrastive=contrastive, rows=rows, vocab=V, k=k,
                          max_abs_diff=diff, ours_ms=t_ours["median_ms"], ours_p20_ms=t_ours["p20_ms"],
                          ours_p80_ms=t_ours["p80_ms"], reference_ms=t_ref["median_ms"],
                          speedup_vs_reference=t_ref["median_ms"] / t_ours["median_ms"], lm_head_gbs=gbs,
                          bandwidth_fraction=gbs / bw)
    table.save()


if __name__ == "__main__":
    main()
