"""The cost side of choosing the draft tree on this machine: the default target's forward
(SmolLM2-135M-Instruct over a 512-token prefix) as a function of the number of tree tokens it
verifies, relative to one plain decoding step, and one draft-tree layer of a Jakiro head
(frontier = top-k rows, its LM head pass included). A tree of T tokens pays off only when the
tokens it adds per round outweigh forward(T) / forward(1) plus the draft's layers."""
import torch

from common import Table, parse_args, timeit
from jakiro_ext import ops
from jakiro_ext.models import load_default_target
from jakiro_ext.models.draft_head import DraftConfig, DraftHead, TreeKV


def main():
    args = parse_args(__doc__)
    table = Table("target_forward", args)
    prefix = 512
    for dtype in (torch.float32, torch.bfloat16):
        target, _ = load_default_target(dtype)
        head = DraftHead(DraftConfig.for_target(target.config, "jakiro")).init_weights(0).bind(target)
        cache = target.new_cache(1, prefix + 64)
        g = torch.Generator().manual_seed(0)
        target(torch.randint(0, 49152, (1, prefix), generator=g), cache, last_logits_only=True)
        cache.lengths += prefix
        draft_cache = head.new_cache(prefix + 64)
        draft_cache.lengths += prefix
        base = None
        for T in ((1, 8, 16, 60) if args.quick else (1, 4, 8, 12, 16, 24, 32, 60)):
            parents = torch.tensor([[-1] + [(i - 1) // 3 for i in range(1, T)]])
            mask = ops.build_tree_mask(parents)
            tokens = torch.randint(0, 49152, (1, T), generator=g)
            t = timeit(lambda: target(tokens, cache, mask), args.reps)
            base = base or t["median_ms"]
            # One draft layer with min(T, 10) frontier rows plus its top-k over the vocabulary.
            rows = min(T, 10)
            itself = ops.pack_bits(torch.eye(rows, dtype=torch.bool)).unsqueeze(0)
            feats = torch.randn(1, rows, 576, generator=g).to(dtype)
            toks = tokens[:, :rows]
            pos = torch.full((1, rows), prefix)

            def draft_layer():
                step = head(toks, feats, pos, draft_cache, itself, TreeKV())
                return ops.contrastive_topk(step.feature[0], None, None, head.lm_head_weight, 10)

            d = timeit(draft_layer, args.reps)
            table.add(dtype=str(dtype).replace("torch.", ""), tree_tokens=T, prefix=prefix, forward_ms=t["median_ms"],
                      forward_p20_ms=t["p20_ms"], forward_p80_ms=t["p80_ms"], relative_to_one_token=t["median_ms"] / base,
                      draft_rows=rows, draft_layer_ms=d["median_ms"])
    table.save()


if __name__ == "__main__":
    main()
