"""A draft head's acceptance profile: how often its rank-r candidate at draft depth d is the
target's token, on held-out examples, drafting from the head's own features as the engine does.
The tree cost model (:mod:`jakiro_ext.engine.tree_cost`) reads it from the head's files."""
from __future__ import annotations

import torch

from jakiro_ext.training.examples import collate
from jakiro_ext.training.loss import MLP_FIRST_DEPTH, mlp_features, scored_step, shifted_rows, unroll


# ----------------------------------------------------------------------------- the head's profile
@torch.no_grad()
def acceptance_profile(head, examples, max_seq_len: int = 512, depth: int = 6, ranks: int = 8,
                       batch_sequences: int = 16) -> dict:
    """p[d][r] (see the module's docstring) on ``examples``' learned tokens, drafting from the
    head's own features as the engine does; for a Jakiro head also its contrastive branch's, for
    a Gumiho head its MLP heads' (after one serial step, as the engine drafts them); an EAGLE-3
    head's from the target's three layers, then its own outputs."""

    mlp_heads = getattr(head.config, "num_mlp_heads", 0)
    hits_m = torch.zeros(mlp_heads, ranks, dtype=torch.float64)
    counts_m = torch.zeros(mlp_heads, dtype=torch.float64)
    hits = torch.zeros(depth, ranks, dtype=torch.float64)
    hits_c = torch.zeros(depth, ranks, dtype=torch.float64)
    counts = torch.zeros(depth, dtype=torch.float64)
    counts_c = torch.zeros(depth, dtype=torch.float64)

    def add(table, count, s, rows):
        pred, tokens = rows.pred[rows.mask], rows.tokens[rows.mask]
        top = head.target_ids((pred @ head.lm_head_weight.T).topk(ranks, -1).indices)  # [n, ranks]
        table[s] += (top == tokens.unsqueeze(-1)).double().sum(0).cpu()  # (the table is the host's)
        count[s] += tokens.numel()

    was_training = head.training
    head.eval()
    for i in range(0, len(examples), batch_sequences):
        b = collate(examples[i: i + batch_sequences], max_seq_len).to(head.fc.weight.device)
        steps = []
        for s, step in unroll(head, b, depth):
            steps.append(step)
            add(hits, counts, s, scored_step(b, step, s, 1))
            if step.expert_out is not None:
                add(hits_c, counts_c, s, scored_step(b, step, s, 2))
        if mlp_heads:
            features = mlp_features(head, b, steps, "drafted")
            for j in range(mlp_heads):
                add(hits_m, counts_m, j, shifted_rows(b, features[:, :, j], MLP_FIRST_DEPTH + j))
    head.train(was_training)
    out = dict(depth_rank=(hits / counts.clamp(min=1).unsqueeze(1)).tolist(), positions=int(counts[0]))
    if head.config.num_experts:
        out["contrastive_depth_rank"] = (hits_c / counts_c.clamp(min=1).unsqueeze(1)).tolist()
    if mlp_heads:
        out["mlp_depth_rank"] = (hits_m / counts_m.clamp(min=1).unsqueeze(1)).tolist()
    return out
