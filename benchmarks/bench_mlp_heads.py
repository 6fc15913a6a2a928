"""Gumiho's parallel MLP heads at drafting shapes: does their pass cost more than reading their
weights? (The issue's rule for a new fused op.) For the shipped head's shape (H = 576, 2 heads of
5 residual blocks, 2.3M parameters each) and the frontier sizes drafting runs (rows), times

- ``drafting``: what the drafter runs, ``DraftHead.mlp_heads`` (each layer through
  ``jakiro::linear``, SiLU and the residual add in PyTorch);
- ``batched``: the same math with one ``torch.baddbmm`` per layer for all heads (the training
  forward's shape, and what a fused op would save at most in launches);

against the floor: the heads' weight bytes over this machine's measured read bandwidth.
"""
import torch
import torch.nn.functional as F

from common import Table, max_abs_diff, memory_bandwidth_gbs, on_device, parse_args, timeit
from jakiro_ext.models.draft_head import DraftConfig, DraftHead
from jakiro_ext.models.llama import LlamaConfig


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
                    ours = lambda: head.mlp_heads(x)  # noqa: E731
                    other = lambda: batched(head, x)  # noqa: E731
                    diff = max_abs_diff(ours(), other())
                    t_ours, t_other = timeit(ours, args.reps), timeit(other, args.reps)
                table.add(dtype=str(dtype).replace("torch.", ""), heads=heads, blocks=config.mlp_blocks, rows=rows,
                          weight_mb=params * head.mlp_in_weight.element_size() / 1e6, floor_ms=floor_ms,
                          drafting_ms=t_ours["median_ms"], drafting_p20_ms=t_ours["p20_ms"],
                          drafting_p80_ms=t_ours["p80_ms"], batched_ms=t_other["median_ms"],
                          drafting_vs_floor=t_ours["median_ms"] / floor_ms, batched_vs_floor=t_other["median_ms"] / floor_ms,
                          max_abs_diff=diff)
    table.save()


if __name__ == "__main__":
    main()
