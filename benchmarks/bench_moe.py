"""Jakiro's MoE block at draft-step shapes: jakiro::moe_top2 against the eager reference (the
Mixtral / Hugging Face loop over experts). Reports time, speedup and the expert-weight read rate."""
import torch

from common import Table, max_abs_diff, memory_bandwidth_gbs, on_device, parse_args, timeit
from jakiro_ext import ops
from jakiro_ext.ops import reference


def main():
    args = parse_args(__doc__)
    table = Table("moe", args)
    bw = memory_bandwidth_gbs(args.threads)
    H = I = 576  # SmolLM2-135M hidden size; the released Jakiro experts use I = H
    for dtype in (torch.float32, torch.bfloat16):
        for N in (4, 8):
            for tokens in ((1, 10) if args.quick else (1, 10, 60)):
                g = torch.Generator().manual_seed(0)
                x = torch.randn(tokens, H, generator=g).to(dtype)
                weights = (torch.randn(N + 2, H, generator=g) * H**-0.5, torch.randn(N, I, H, generator=g) * H**-0.5,
                           torch.randn(N, I, H, generator=g) * H**-0.5, torch.randn(N, H, I, generator=g) * I**-0.5)
                x, *weights = on_device(x, *(w.to(dtype) for w in weights))
                ours = lambda: ops.moe_top2(x, *weights)  # noqa: E731
                ref = lambda: reference.moe_top2(x, *weights)  # noqa: E731
                diff = max_abs_diff(ours()[0], ref()[0])
                active = int(ours()[2].unique().numel())
                t_ours, t_ref = timeit(ours, args.reps), timeit(ref, args.reps)
                weight_bytes = active * 3 * H * I * x.element_size()
                gbs = weight_bytes / (t_ours["median_ms"] * 1e-3) / 1e9
                table.add(dtype=str(dtype).replace("torch.", ""), experts=N, tokens=tokens, active_experts=active,
                          max_abs_diff=diff, ours_ms=t_ours["median_ms"], ours_p20_ms=t_ours["p20_ms"],
                          ours_p80_ms=t_ours["p80_ms"], reference_ms=t_ref["median_ms"],
                          speedup_vs_reference=t_ref["median_ms"] / t_ours["median_ms"], weight_gbs=gbs,
                          bandwidth_fraction=gbs / bw)
    table.save()


if __name__ == "__main__":
    main()
