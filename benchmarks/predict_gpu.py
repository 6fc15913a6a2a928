"""What the tree-choice model (jakiro_ext.engine.tree_cost) predicts for the shipped heads on a GPU, where
no GPU was at hand to measure: the round's costs from a weight-read model instead of this
machine's measurements. At batch 1 a GPU runs SmolLM2's forwards far below its compute, so each
is taken to cost its weight bytes over the memory bandwidth (CUDA graphs: launches free):

- verification of N <= 64 tokens: the target's weights, whatever N (its 64 rows are ~1% of an
  H100's compute at the time the weights take to read);
- a draft forward (a tree layer, or the catch-up): the head's serial layers; an LM-head pass:
  the draft vocabulary's rows; Gumiho's MLP pass: its MLP heads (one fused call);
- ``eagle2`` at depth D: D forwards and D + 1 LM-head passes; ``jakiro``: D - 1 and D (the
  contrastive layer shares the last pass); ``gumiho`` with J heads: D - J forwards, D - J + 1
  passes, the MLP pass and one more LM-head pass for all its heads.

Every cost is in units of one verification, so the bandwidth drops out. The expected accepted
tokens come from each head's acceptance profile (acceptance.json), and the tree is chosen as on
the CPU; printed: the chosen tree, the expected accepted tokens per round and the predicted
speedup over plain decoding (one verification per token).
"""
import argparse

import torch

from jakiro_ext.config import MAX_TREE_NODES
from jakiro_ext.engine.tree_cost import SIZES, WIDTHS, choose_tree, tree_depths


def head_bytes(head) -> dict:
    c = head.config
    element = 4  # float32 weights at run time
    mlp = sum(p.numel() for n, p in head.named_parameters() if n.startswith("mlp_"))
    serial = sum(p.numel() for n, p in head.named_parameters() if not n.startswith("mlp_"))
    vocab = c.draft_vocab_size or c.vocab_size
    return dict(forward=serial * element, lm_pass=vocab * c.hidden_size * element, mlp=mlp * element)


def gpu_costs(target, head, method: str) -> dict:
    verify = sum(p.numel() for p in target.parameters()) * 4
    b = {k: v / verify for k, v in head_bytes(head).items()}
    J = head.config.num_mlp_heads if method == "gumiho" else 0
    draft = {}
    for k in WIDTHS:
        for d in tree_depths(head, method):
            if method == "jakiro":
                cost = (d - 1) * b["forward"] + d * b["lm_pass"]
            elif method == "gumiho":
                cost = (d - J) * b["forward"] + (d - J + 2) * b["lm_pass"] + b["mlp"]
            else:
                cost = d * b["forward"] + (d + 1) * b["lm_pass"]
            draft[f"{d},{k}"] = cost
    return dict(verify={str(n): 1.0 for n in SIZES if n <= MAX_TREE_NODES}, draft=draft,
                catch_up={str(n): b["forward"] for n in range(1, 9)}, batch=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", default=["eagle2:eagle2", "jakiro:jakiro", "gumiho:gumiho"],
                    help="METHOD:KIND or METHOD:DIR pairs (KIND: a shipped head)")
    args = ap.parse_args()
    from jakiro_ext.cli.common import load_head
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_target

    target, _ = load_default_target(torch.float32)
    print("| method | head | chosen tree (N/D/K) | expected accepted | predicted speedup over plain decoding |")
    print("|---|---|---|---|---|")
    for pair in args.heads:
        method, which = pair.split(":")
        kind = which if "/" not in which else None
        head = load_head(kind or method, None if kind else which, target, DEFAULT_MODEL)
        costs = gpu_costs(target, head, method)
        tree, rows = choose_tree(costs, head.acceptance, method)
        rate, accepted = rows[0][0], rows[0][1]
        print(f"| {method} | {which} | {tree.total_tokens}/{tree.depth}/{tree.top_k} | {accepted:.2f} | {rate:.2f}x |")


if __name__ == "__main__":
    main()
