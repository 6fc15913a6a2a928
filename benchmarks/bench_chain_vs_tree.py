"""What a serving engine's drafting costs a Jakiro head in acceptance: the shipped Jakiro head
drafting a chain of top-1 tokens from its main branch (what vLLM's EAGLE proposer does:
``num_speculative_tokens`` k, one token a step), and SGLang-style top-k trees from the main branch,
against the same head with Jakiro's own drafting (its tree, the last layer from the contrastive
branch), at equal numbers of verified tokens per round. Acceptance only (tokens per round), so no
timing: tau = new tokens / rounds, the prompt's forward not counted. SmolLM2-135M-Instruct in
float32, the packaged prompts (chat template), temperature 0, batch 1; every run's tokens are
checked against plain decoding.

Writes ``results/chain_vs_tree.csv``."""
import argparse
import json
import os
from pathlib import Path

import torch

from common import RESULTS, machine, write_csv

# (label, method, nodes N (root included), depth, top_k): the engines draft from the main branch
# (method eagle2 on a Jakiro head); Jakiro's own trees take their last layer from the contrastive one.
CONFIGS = [("chain (vLLM)", "eagle2", n, n - 1, 1) for n in (3, 4, 5)] + \
          [("top-k tree (SGLang)", "eagle2", n, 2, 2) for n in (3, 4, 5)] + \
          [("Jakiro tree", "jakiro", n, 2, 2) for n in (3, 4, 5)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=40, help="the first N packaged prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(RESULTS, "chain_vs_tree.csv"))
    args = ap.parse_args()

    from jakiro_ext.cli.common import HEADS_DIR, chat_ids, load_head
    from jakiro_ext.config import TreeConfig
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.methods import METHODS
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_target

    target, tokenizer = load_default_target(torch.float32)
    head = load_head(METHODS["jakiro"].shipped_head, None, target, DEFAULT_MODEL)
    prompts = [chat_ids(tokenizer, json.loads(line)["prompt"], True).flatten()
               for line in (Path(HEADS_DIR).parent / "data" / "prompts.jsonl").read_text().splitlines()
               if line.strip()][:args.limit]
    plain = [speculative_generate(target, None, p, args.max_new_tokens, method="ar",
                                  eos_token_id=tokenizer.eos_token_id).token_ids for p in prompts]
    rows = []
    for label, method, n, depth, top_k in CONFIGS:
        tokens = rounds = 0
        for p, want in zip(prompts, plain):
            out = speculative_generate(target, head, p, args.max_new_tokens, method=method,
                                       tree=TreeConfig(n, depth, top_k), eos_token_id=tokenizer.eos_token_id)
            assert out.token_ids == want, f"{label} {n}: tokens differ from plain decoding"
            tokens += sum(1 + a for a in out.stats.accept_lengths)
            rounds += len(out.stats.accept_lengths)
        rows.append(dict(drafting=label, method=method, nodes=n, depth=depth, top_k=top_k,
                         tau=round(tokens / rounds, 3), rounds=rounds, machine=machine()))
        print(f"{label:20s} N={n} D={depth} K={top_k}: tau {tokens / rounds:.3f} ({rounds} rounds)", flush=True)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
