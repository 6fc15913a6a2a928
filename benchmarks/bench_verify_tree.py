"""Tree verification at EAGLE-2 shapes (60 nodes, SmolLM2's 49152-token vocabulary):
jakiro::verify_tree against the pure-PyTorch reference, greedy and sampling."""
import torch

from common import Table, max_abs_diff, on_device, parse_args, timeit
from jakiro_ext import ops
from jakiro_ext.ops import reference


def main():
    args = parse_args(__doc__)
    table = Table("verify_tree", args)
    T, V = 60, 49152
    for batch in ((1,) if args.quick else (1, 4)):
        g = torch.Generator().manual_seed(0)
        parents = torch.tensor([[-1] + [max(0, i - 1 - (i % 7)) for i in range(1, T)]]).repeat(batch, 1)
        tokens = torch.randint(0, V, (batch, T), generator=g)
        logits = torch.randn(batch, T, V, generator=g) * 3
        for b in range(batch):  # the target prefers the draft's last child everywhere: deep acceptance
            for node in range(T):
                kids = (parents[b] == node).nonzero().flatten()
                if len(kids):
                    logits[b, node, tokens[b, kids[-1]]] = 30.0
        uniforms = torch.rand(batch, T + 1, generator=g, dtype=torch.float64)
        host = (parents, tokens, logits, uniforms)  # the reference runs on the CPU
        parents, tokens, logits, uniforms = on_device(*host)
        for mode, kw in (("greedy", dict(temperature=0.0)), ("sampling", dict(temperature=0.8, top_p=0.95)),
                         ("sampling-topk", dict(temperature=0.8, top_k=50))):
            ours = lambda: ops.verify_tree(parents, tokens, logits, uniforms, **kw)  # noqa: E731
            ref = lambda: reference.verify_tree(*host, **kw)  # noqa: E731
            diff = max_abs_diff(tuple(t.cpu() for t in ours()), ref())
            t_ours, t_ref = timeit(ours, args.reps), timeit(ref, max(3, args.reps // 5))
            table.add(mode=mode, batch=batch, nodes=T, vocab=V, accepted=float(ours()[1].float().mean()),
                      max_abs_diff=diff, ours_ms=t_ours["median_ms"], ours_p20_ms=t_ours["p20_ms"],
                      ours_p80_ms=t_ours["p80_ms"], reference_ms=t_ref["median_ms"],
                      speedup_vs_reference=t_ref["median_ms"] / t_ours["median_ms"])
    table.save()


if __name__ == "__main__":
    main()
