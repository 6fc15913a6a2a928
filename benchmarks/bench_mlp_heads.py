"""Gumiho's parallel MLP heads at drafting shapes: what their pass costs against reading their
weights (the floor: the heads' weight bytes over this machine's measured read bandwidth). For
the shipped head's shape (H = 576, 2 heads of 5 residual blocks, 2.3M parameters each; and 5
heads) and the frontier sizes drafting runs (rows), times

- ``fused``: ``jakiro::mlp_heads``, what the drafter runs (one call, one parallel region a layer);
- ``unfused``: each layer through ``jakiro::linear`` (row-exact), SiLU and the residual add in
  PyTorch: 3 calls a layer and head (what the drafter ran before the op);
- ``batched``: one ``torch.baddbmm`` a layer for all the heads (MKL; not row-exact).
"""
import torch
import torch.nn.functional as F

from common import Table, max_abs_diff, memory_bandwidth_gbs, on_device, parse_args, timeit
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext import ops
from jakiro_ext.models.llama import LlamaConfig


def unfused(head: DraftHead, x: torch.Tensor) -> torch.Tensor:
    c, outs = head.config, []
    for j in range(c.num_mlp_heads):
        h = F.silu(ops.linear(x, head.mlp_in_weight[j], head.mlp_in_bias[j]))
        for b in range(c.mlp_blocks):
            h = h + F.silu(ops.linear(h, head.mlp_block_weight[j, b], head.mlp_block_bias[j, b]))
        outs.append(h)
    return torch.stack(outs, -2)


def batched(head: DraftHead, x: torch.Tensor) -> torch.Tensor:
    c = head.config
    rows = x.reshape(1, -1, 2 * c.hidden_size).expand(c.num_mlp_heads, -1, -1)
    h = F.silu(torch.baddbmm(head.mlp_in_bias.unsqueeze(1), rows, head.mlp_in_weight.transpose(1, 2)))
    for b in range(c.mlp_blocks):
        h = h + F.silu(torch.baddbmm(head.mlp_block_bias[:, b].unsqueeze(1), h, head.mlp_block_weight[:, b].transpose(1, 2)))
    return h.transpose(0, 1).reshape(*x.shape[:-1], c.num_mlp_heads, c.hidden_size)


def main():
    args = parse_args(__doc__)
    table = Table("mlp_heads", args)
    bw = memory_bandwidth_gbs(args.threads)
    target = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64)
    for dtype in (torch.float32, torch.bfloat16):
        for heads in (2, 5):
            config = DraftConfig.for_target(target, "gumiho", intermediate_size=640, num_mlp_heads=heads)
            head = DraftHead(config).init_weights(0)
            with torch.no_grad():
                head.mlp_block_weight.normal_(0, 0.02)
            head = on_device(head.to(dtype))
            params = sum(p.numel() for n, p in head.named_parameters() if n.startswith("mlp_"))
            floor_ms = params * head.mlp_in_weight.element_size() / (bw * 1e9) * 1e3
            for rows in ((1, 4) if args.quick else (1, 2, 4, 8, 16)):
                x = on_device(torch.randn(1, rows, 2 * config.hidden_size, generator=torch.Generator().manual_seed(1))
                              .to(dtype))
                with torch.no_grad():
                    runs = {"fused": lambda: head.mlp_heads(x), "unfused": lambda: unfused(head, x),
                            "batched": lambda: batched(head, x)}
                    diff = max(max_abs_diff(runs["fused"](), run()) for run in runs.values())
                    times = {name: timeit(run, args.reps) for name, run in runs.items()}
                row = dict(dtype=str(dtype).replace("torch.", ""), heads=heads, blocks=config.mlp_blocks, rows=rows,
                           weight_mb=params * head.mlp_in_weight.element_size() / 1e6, floor_ms=floor_ms)
                for name, t in times.items():
                    row.update({f"{name}_ms": t["median_ms"], f"{name}_vs_floor": t["median_ms"] / floor_ms})
                table.add(**row, fused_p20_ms=times["fused"]["p20_ms"], fused_p80_ms=times["fused"]["p80_ms"],
                          max_abs_diff=diff)
    table.save()


if __name__ == "__main__":
    main()
