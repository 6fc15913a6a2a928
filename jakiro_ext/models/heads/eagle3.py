"""EAGLE-3 draft heads, as released (EAGLE's ``cnets.py``, SpecForge's ``LlamaForCausalLMEagle3``,
what vLLM and SGLang load for their ``eagle3`` method).

Unlike the EAGLE-1/2 head (:mod:`jakiro_ext.models.heads.draft_head`), the head reads three of the
target's layers and has its own LM head:

- its input feature for a committed token is ``fc(cat(h_low, h_mid, h_high))`` ([H, 3H], no
  bias), the residual streams entering the target's layers ``feature_layers`` (default 2, L / 2
  and L - 3, as vLLM), which the target returns instead of its final hidden state
  (``LlamaModel.forward(feature_layers=...)``); a drafted token's is the head's own output;
- one decoder layer whose attention reads ``cat(input_layernorm(embed(token)), hidden_norm(h))``
  (q/k/v over 2H), with the residual ``h``, then ``post_attention_layernorm`` and a SwiGLU MLP;
- the logits are ``lm_head(norm(out))`` over a draft vocabulary of its own, draft id d being
  target id ``d + d2t[d]``.

Checkpoint keys: ``fc.weight``, ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}
.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` (and optionally ``embed_tokens.weight``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn

from jakiro_ext import ops
from jakiro_ext.kv_cache import BufferPool, KVCache
from jakiro_ext.models.heads.config import ACCEPTANCE_FILE, DraftConfig, default_feature_layers, write_head_files
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.head import check_target_shapes, load_checked_state, new_head_cache
from jakiro_ext.models.heads.formats import (ATTENTION, MLP, HeadFormat, check_layer_config, read_weights, register,
                                             tensor_getter)
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.heads import drafting
from jakiro_ext.models.llama import LlamaModel, RMSNorm, as_target, project

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    feature_layers: List[int] = field(default_factory=list)  # empty: 2, L / 2, L - 3 of the target
    max_position_embeddings: int = 2048  # (what the serving engines size the draft's positions by)
    num_experts: int = 0  # (a dense head: what the drafter asks of every head)
    target: str = ""

    @property
    def kind(self) -> str:
        return "eagle3"

    cache_shape = DraftConfig.cache_shape  # (the same fields: the draft cache's geometry)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head: a :class:`~jakiro_ext.models.heads.head.Head` beside
    :class:`~jakiro_ext.models.heads.draft_head.DraftHead` (the engine drafts with it as with a
    dense head: method ``eagle2``). Loaded with ``DraftHead.load`` or :meth:`load`."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        H = c.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * H, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * H, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * H, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size, dtype=torch.int64))
        self.embed_weight: Optional[torch.Tensor] = None
        self.lm_head_weight: Optional[torch.Tensor] = None
        self.feature_layers: tuple = tuple(c.feature_layers)
        self.acceptance: Optional[dict] = None

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids]

    @classmethod
    def load(cls, path, target: Optional[LlamaModel] = None) -> "Eagle3Head":
        """The released EAGLE-3 head in the directory ``path`` (bound to ``target`` when given)."""
        return DraftHead.load(path, target, format="eagle3")

    def check_target(self, target: LlamaModel) -> None:
        check_target_shapes(self.config, target)
        layers = target.config.num_layers
        wanted = self.config.feature_layers or list(default_feature_layers(layers))
        if len(wanted) != 3 or not all(0 <= i <= layers for i in wanted):  # (L: after the last layer, this package's)
            raise ValueError(f"an EAGLE-3 head reads the streams entering three of the target's {layers} layers "
                             f"(0..{layers}, {layers}: after the last), got feature layers {wanted}")

    def bind(self, target) -> "Eagle3Head":
        """Share the target's embedding; the head keeps its own LM head."""
        target = as_target(target)
        self.check_target(target)
        layers = target.config.num_layers
        self.feature_layers = tuple(self.config.feature_layers or default_feature_layers(layers))
        self.embed_weight = target.embed_tokens.weight.detach()
        self.to(dtype=target.activation_dtype, device=target.lm_head.weight.device)
        self.lm_head_weight = self.lm_head.weight.detach()
        return self

    def products(self) -> drafting.Products:
        """What drafting's products read (:func:`jakiro_ext.models.heads.drafting.drafting_products`)."""
        return drafting.drafting_products(self)

    def new_cache(self, capacity: int, max_capacity: Optional[int] = None, batch: int = 1,
                  pool: Optional[BufferPool] = None) -> KVCache:
        return new_head_cache(self.config, self.fc.weight, capacity, max_capacity, batch, pool)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor, ancestors=None) -> DraftStep:
        """One draft forward over T new rows (see :meth:`DraftHead.forward`); ``features`` are the
        target's three layers [B, T, 3H] (committed tokens) or the head's own outputs [B, T, H]."""
        h = features.to(self.fc.weight.dtype)
        if h.shape[-1] == 3 * self.config.hidden_size:
            h = project(self.fc, h)
        x = torch.cat([self.input_layernorm(ops.embedding(self.embed_weight, tokens)), self.hidden_norm(h)], -1)
        u = h + drafting.attention(self, x, positions, cache, tree_mask, ancestors)
        out = u + drafting.mlp(self, self.post_attention_layernorm(u))
        return DraftStep(out, u, lm_input=self.norm(out))

    # ------------------------------------------------------------------ the released format
    @classmethod
    def from_released(cls, config: dict, state: Dict[str, torch.Tensor], where: str) -> "Eagle3Head":
        """The head of a released EAGLE-3 checkpoint (config.json, tensors); anything that does
        not fit is a ValueError naming ``where`` and the key or shape."""
        need = tensor_getter(state, "an eagle3 head", where)
        check_layer_config(config, where)
        fc, lm_head = need("fc.weight"), need("lm_head.weight")
        H = fc.shape[0]
        if list(fc.shape) != [H, 3 * H]:
            raise ValueError(f"{where}: fc.weight must be [H, 3H] (three target layers), got {list(fc.shape)}")
        heads = config.get("num_attention_heads")
        if not heads or config.get("vocab_size") is None:
            raise ValueError(f"{where}: config.json needs num_attention_heads and vocab_size")
        aux = ((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
               or config.get("eagle_aux_hidden_state_layer_ids") or [])
        c = Eagle3Config(hidden_size=H, vocab_size=config["vocab_size"], draft_vocab_size=lm_head.shape[0],
                         num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
                         head_dim=config.get("head_dim") or H // heads,
                         intermediate_size=need("midlayer.mlp.gate_proj.weight").shape[0],
                         rope_theta=float(config.get("rope_theta", 10000.0)),
                         rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), feature_layers=list(aux),
                         max_position_embeddings=int(config.get("max_position_embeddings") or 2048))
        declared = config.get("draft_vocab_size", c.draft_vocab_size)
        if declared != c.draft_vocab_size:
            raise ValueError(f"{where}: lm_head.weight has {c.draft_vocab_size} rows, config.json says "
                             f"draft_vocab_size {declared}")
        ours = {"fc.weight": fc, "lm_head.weight": lm_head, "norm.weight": need("norm.weight")}
        for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            ours[f"{name}.weight"] = need(f"midlayer.{name}.weight")
        for name in ATTENTION:
            ours[f"{name}.weight"] = need(f"midlayer.self_attn.{name}.weight")
        for name in MLP:
            ours[f"{name}.weight"] = need(f"midlayer.mlp.{name}.weight")
        d2t = need("d2t").long()
        if list(d2t.shape) != [c.draft_vocab_size]:
            raise ValueError(f"{where}: d2t must have one offset per draft token ({c.draft_vocab_size}), got "
                             f"{list(d2t.shape)}")
        ours["draft_to_target"] = torch.arange(c.draft_vocab_size) + d2t
        if int(ours["draft_to_target"].min()) < 0 or int(ours["draft_to_target"].max()) >= c.vocab_size:
            raise ValueError(f"{where}: d2t maps draft tokens outside the target's vocabulary [0, {c.vocab_size})")
        used = {f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")} | {
            f"midlayer.self_attn.{n}.weight" for n in ATTENTION} | {f"midlayer.mlp.{n}.weight" for n in MLP} | {
            "fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d", "embed_tokens.weight"}
        unknown = sorted(set(state) - used)
        if unknown:
            raise ValueError(f"{where}: tensors an eagle3 head does not have: {unknown[:4]}")
        head = cls(c)
        load_checked_state(head, ours, Path(where))
        return head

    def released_files(self) -> tuple:
        """(config.json, tensors) in the released EAGLE-3 format."""
        c = self.config
        config = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
                  "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                  "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
                  "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                  "max_position_embeddings": c.max_position_embeddings,
                  "rope_scaling": None, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
                  "tie_word_embeddings": False}
        if c.feature_layers:  # (vLLM reads them in eagle_config, SpecForge and llama.cpp's converter at the top)
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers)}
            config["eagle_aux_hidden_state_layer_ids"] = list(c.feature_layers)
        mine = self.state_dict()
        state = {"fc.weight": mine["fc.weight"], "norm.weight": mine["norm.weight"], "lm_head.weight": mine["lm_head.weight"]}
        for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            state[f"midlayer.{name}.weight"] = mine[f"{name}.weight"]
        state.update({f"midlayer.self_attn.{n}.weight": mine[f"{n}.weight"] for n in ATTENTION})
        state.update({f"midlayer.mlp.{n}.weight": mine[f"{n}.weight"] for n in MLP})
        d2t = mine["draft_to_target"]
        state["d2t"] = d2t - torch.arange(c.draft_vocab_size, device=d2t.device)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device=d2t.device)
        state["t2d"] = t2d.index_fill(0, d2t, True)
        return config, state

    def save(self, path, dtype: Optional[torch.dtype] = None, metadata: Optional[dict] = None,
             format: str = "eagle3", full_vocabulary: bool = False, extra_files: Optional[dict] = None) -> None:
        """The released EAGLE-3 format (its only format here): config.json and model.safetensors
        (and ``extra_files``), the directory replaced atomically."""
        if format != "eagle3":
            raise ValueError(f"an EAGLE-3 head is saved in the eagle3 format, got format={format!r}")
        extra = dict(extra_files or {})
        if self.acceptance is not None:  # (this package's tree choice reads it; the serving engines ignore it)
            extra[ACCEPTANCE_FILE] = json.dumps(self.acceptance, indent=1) + "\n"
        write_head_files(path, *self.released_files(), dtype, {"kind": "eagle3", **(metadata or {})}, extra)


def _read_eagle3(cls, path: Path, config: dict, fits, weights=None) -> Eagle3Head:
    state, file = weights or read_weights(path)
    head = Eagle3Head.from_released(config, state, str(file))
    fits(head)
    return head


register(HeadFormat("eagle3", _read_eagle3, lambda head, full_vocabulary: head.released_files()))
