"""What one draft forward returns (``DraftStep``): the features the engine drafts from and the
training loss reads."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class DraftStep(NamedTuple):
    """One draft forward's outputs for its T rows (shapes [B, T, ...]).

    feature : the predicted next target feature (MoE: u + s_0 h_0 + s_1 h_1; dense: u + MLP(u)).
    residual : u, the attention block's output (the MoE's residual).
    expert_out, expert_score, contrast_weight : MoE heads only (else None): the top-2 experts'
        outputs [.., 2, H] (higher score first), their gate scores and (w_hi, w_lo).
    lm_input : what the LM head reads, when it is not ``feature`` (EAGLE-3 heads).
    projected : Gumiho heads only: ``fc(cat(embed(token), feature))``, the rows' input to the
        serial layers and the first half of their children's MLP-head input.
    """
    feature: torch.Tensor
    residual: torch.Tensor
    expert_out: Optional[torch.Tensor] = None
    expert_score: Optional[torch.Tensor] = None
    contrast_weight: Optional[torch.Tensor] = None
    lm_input: Optional[torch.Tensor] = None  # what the LM head reads when not the feature (EAGLE-3: norm(feature))
    projected: Optional[torch.Tensor] = None

    @property
    def for_lm_head(self) -> torch.Tensor:
        return self.feature if self.lm_input is None else self.lm_input

    def contrastive_feature(self) -> torch.Tensor:
        """u + w_hi * h_0 - w_lo * h_1: the feature two tokens ahead (Jakiro's parallel step)."""
        w = self.contrast_weight.to(self.residual.dtype)
        h = self.expert_out
        return self.residual + w[..., 0:1] * h[..., 0, :] - w[..., 1:2] * h[..., 1, :]

    def rows(self, rows: torch.Tensor) -> "DraftStep":
        """Every field at rows [B, R] of each sequence: [B, R, ...]."""
        return DraftStep(*(None if t is None else take_rows(t, rows) for t in self))

    def last_kept(self, counts: torch.Tensor) -> "DraftStep":
        """Every field at each sequence's row ``counts[b] - 1`` (row 0 where it keeps none): [B, 1, ...]."""
        return self.rows((counts - 1).clamp(min=0).view(-1, 1))

    def of_sequences(self, index: torch.Tensor) -> "DraftStep":
        """Every field for the sequences ``index`` [B'] (in that order)."""
        return DraftStep(*(None if t is None else t[index] for t in self))

    def branch_features(self) -> torch.Tensor:
        """[B, T, 2, H]: each activated expert's own feature u + (s_0 + s_1) h_j (Jakiro*), with
        the experts' total gate mass, so both equal ``feature`` when the two experts agree."""
        mass = self.expert_score.sum(-1, keepdim=True).unsqueeze(-1).to(self.residual.dtype)
        return self.residual.unsqueeze(-2) + mass * self.expert_out


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t [B, T, ...] at rows [B, R] of each sequence: [B, R, ...]."""
    index = rows.view(*rows.shape, *([1] * (t.dim() - 2))).expand(*rows.shape, *t.shape[2:])
    return t.gather(1, index)
