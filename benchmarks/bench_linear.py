"""jakiro::linear (the weight streamed once) against torch.nn.functional.linear (BLAS) on the
SmolLM2-135M projections and LM head, from one token to a prompt-sized block; shows where the
float32 BLAS crossover (kLinearStreamRows = 64) lies. Reports time, speedup and the weight's
read rate. Those weights fit in the cache after the first repetition; a decode step streams its
weights from memory, so the last rows (``source=memory``) time one pass over distinct weights of
the MLP's shape, more of them than any cache holds (as many bytes as the model's), at 1 to 6 rows
(a tree's verification): the read rate there is the kernel's weight prefetch at work."""
import torch
import torch.nn.functional as F

from common import Table, max_abs_diff, memory_bandwidth_gbs, on_device, parse_args, timeit
from jakiro_ext import ops


def main():
    args = parse_args(__doc__)
    table = Table("linear", args)
    bw = memory_bandwidth_gbs(args.threads)
    shapes = {"qkv/o 576x576": (576, 576), "mlp up 1536x576": (1536, 576), "lm_head 49152x576": (49152, 576)}
    for dtype in (torch.float32, torch.bfloat16):
        for name, (N, K) in shapes.items():
            for rows in ((1, 16, 60) if args.quick else (1, 4, 8, 16, 32, 60, 64, 100)):
                g = torch.Generator().manual_seed(0)
                x = torch.randn(rows, K, generator=g).to(dtype)
                w = (torch.randn(N, K, generator=g) * K**-0.5).to(dtype)
                x, w = on_device(x, w)
                ours = lambda: ops.linear(x, w)  # noqa: E731
                ref = lambda: F.linear(x, w)  # noqa: E731
                diff = max_abs_diff(ours(), F.linear(x.float(), w.float()).to(dtype))
                t_ours, t_ref = timeit(ours, args.reps), timeit(ref, args.reps)
                gbs = w.numel() * w.element_size() / (t_ours["median_ms"] * 1e-3) / 1e9
                table.add(dtype=str(dtype).replace("torch.", ""), weight=name, rows=rows, source="cache",
                          max_abs_diff=diff,
                          ours_ms=t_ours["median_ms"], ours_p20_ms=t_ours["p20_ms"], ours_p80_ms=t_ours["p80_ms"],
                          torch_ms=t_ref["median_ms"], speedup_vs_torch=t_ref["median_ms"] / t_ours["median_ms"],
                          weight_gbs=gbs, bandwidth_fraction=gbs / bw)
    for dtype in (torch.float32, torch.bfloat16):
        N, K = shapes["mlp up 1536x576"]
        g = torch.Generator().manual_seed(0)
        count = int(906e6 // (N * K * torch.finfo(dtype).bits // 8))  # (the model's fp32 weights; beyond any L3 seen)
        weights = [on_device((torch.randn(N, K, generator=g) * K**-0.5).to(dtype)) for _ in range(count)]
        total_bytes = count * N * K * weights[0].element_size()
        for rows in (1, 2, 3, 4, 6):
            x = on_device(torch.randn(rows, K, generator=g).to(dtype))
            t = timeit(lambda: [ops.linear(x, w) for w in weights], max(3, args.reps // 5))
            gbs = total_bytes / (t["median_ms"] * 1e-3) / 1e9
            table.add(dtype=str(dtype).replace("torch.", ""), weight=f"{count} x mlp up 1536x576", rows=rows,
                      source="memory", ours_ms=t["median_ms"], ours_p20_ms=t["p20_ms"], ours_p80_ms=t["p80_ms"],
                      weight_gbs=gbs, bandwidth_fraction=gbs / bw)
        del weights
    table.save()


if __name__ == "__main__":
    main()
