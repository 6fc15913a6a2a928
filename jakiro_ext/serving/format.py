"""The ``serving`` format: a one-layer draft head, dense (EAGLE-2) or MoE (Jakiro), as the engine
plugins load it (``head.save(dir, format="serving")``, read back by ``DraftHead.load``).

``config.json`` is a Llama config that both engines parse (``model_type`` llama) naming the
plugins' class, :data:`ARCHITECTURE`, with this package's settings under the key ``"jakiro"``
(a top-level ``num_experts`` would make vLLM treat the draft as one of its own MoE models). No
``bias`` key (vLLM would build attention biases that nothing loads), ``tie_word_embeddings``
false. Tensors (safetensors):

- ``fc.weight`` [H, 2H], ``fc.bias`` [H]: over ``cat(embedding, feature)``;
- ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.post_attention_layernorm.weight``
  (no norm before layer 0's attention, no final norm: EAGLE's layout);
- MoE: ``layers.0.mlp.router`` [N + 2, H], ``layers.0.mlp.w_gate`` / ``w_up`` [N, I, H],
  ``layers.0.mlp.w_down`` [N, H, I]; dense: ``layers.0.mlp.{gate,up,down}_proj.weight``;
- ``draft_to_target`` (int64) when the head drafts over part of the target's vocabulary.

The embedding and the LM head are the target's (the engines share them). What the format does not
carry: the contrastive last step (the engines draft a chain, vLLM, or a top-k tree, SGLang, from
the head's main branch), this package's trees, Gumiho's MLP heads and multi-layer heads.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

ARCHITECTURE = "EagleJakiroLlamaForCausalLM"  # starts with "Eagle": vLLM's eagle method keeps the name
FORMAT_VERSION = 1
MAX_POSITIONS = 32768  # the draft's RoPE range as written (vLLM raises it to the target's; SGLang reads it)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE = ("gate_proj", "up_proj", "down_proj")
EXPERTS = ("router", "w_gate", "w_up", "w_down")


def serving_files(head) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """config.json and the tensors of a one-layer head (a DraftHead) in the serving format."""
    c = head.config
    if c.feature_layers:
        raise ValueError(f"the serving format holds heads reading the target's final hidden state; this one reads target "
                         f"layers {c.feature_layers} fused: it is saved in this package's format (format='jakiro_ext')")
    if c.num_mlp_heads or c.num_layers > 1:
        raise ValueError(f"the serving format holds one-layer heads without MLP heads: this {c.kind} head has "
                         f"{c.num_layers} layers and {c.num_mlp_heads} MLP heads")
    config = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "max_position_embeddings": MAX_POSITIONS, "vocab_size": c.vocab_size, "tie_word_embeddings": False,
              "attention_bias": False,
              "jakiro": {"format_version": FORMAT_VERSION, "kind": c.kind, "num_experts": c.num_experts,
                         "expert_intermediate_size": c.intermediate_size if c.num_experts else 0,
                         "renormalize": c.renormalize, "draft_vocab_size": c.draft_vocab_size, "target": c.target}}
    mine = head.state_dict()
    state = {"fc.weight": mine["fc.weight"], "fc.bias": mine["fc.bias"],
             "layers.0.post_attention_layernorm.weight": mine["post_attention_layernorm.weight"]}
    state.update({f"layers.0.self_attn.{n}.weight": mine[f"{n}.weight"] for n in ATTENTION})
    if c.num_experts:
        state.update({f"layers.0.mlp.{n}": mine[n] for n in EXPERTS})
    else:
        state.update({f"layers.0.mlp.{n}.weight": mine[f"{n}.weight"] for n in DENSE})
    if c.draft_vocab_size:
        state["draft_to_target"] = mine["draft_to_target"]
    return config, state


def is_serving(config: dict) -> bool:
    return config.get("architectures") == [ARCHITECTURE]


def settings(config: dict, where: str) -> dict:
    """The ``"jakiro"`` settings of a serving config; a config of another format version is a
    ValueError naming ``where``."""
    own = config.get("jakiro")
    if not isinstance(own, dict) or own.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where}: a serving-format config needs \"jakiro\": {{\"format_version\": {FORMAT_VERSION}, ...}}, "
                         f"got {own!r}")
    return own


def from_serving(config: dict, state: Dict[str, torch.Tensor], where: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(the DraftConfig's fields, this package's state dict) of a serving-format head; a tensor
    missing or unknown is a ValueError naming ``where`` and the tensor."""
    own = settings(config, where)

    def need(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"{where}: a serving-format head needs the tensor {key!r}, which is missing")
        return state[key]
    experts = int(own.get("num_experts", 0))
    ours = {"fc.weight": need("fc.weight"), "fc.bias": need("fc.bias"),
            "post_attention_layernorm.weight": need("layers.0.post_attention_layernorm.weight")}
    ours.update({f"{n}.weight": need(f"layers.0.self_attn.{n}.weight") for n in ATTENTION})
    if experts:
        ours.update({n: need(f"layers.0.mlp.{n}") for n in EXPERTS})
        width = ours["w_gate"].shape[1]
    else:
        ours.update({f"{n}.weight": need(f"layers.0.mlp.{n}.weight") for n in DENSE})
        width = ours["gate_proj.weight"].shape[0]
    if own.get("draft_vocab_size"):
        ours["draft_to_target"] = need("draft_to_target")
    names = {"fc.weight": None, "fc.bias": None, "layers.0.post_attention_layernorm.weight": None, "draft_to_target": None}
    names.update({f"layers.0.self_attn.{n}.weight": None for n in ATTENTION})
    names.update({f"layers.0.mlp.{n}": None for n in EXPERTS} if experts else
                 {f"layers.0.mlp.{n}.weight": None for n in DENSE})
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise ValueError(f"{where}: tensors a serving-format head does not have: {unknown[:4]}")
    fields = dict(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                  num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                  head_dim=config["head_dim"], intermediate_size=width, num_experts=experts,
                  rope_theta=float(config["rope_theta"]), rms_norm_eps=float(config["rms_norm_eps"]),
                  renormalize=bool(own.get("renormalize", False)), draft_vocab_size=int(own.get("draft_vocab_size", 0)),
                  target=str(own.get("target", "")))
    return fields, ours


def blocked_tokens(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool: the target's tokens outside the draft vocabulary (their draft logits
    are set to -inf: the head never drafts them)."""
    ids = draft_to_target.to(torch.int64).flatten()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"draft_to_target holds ids outside [0, {vocab_size})")
    blocked = torch.ones(vocab_size, dtype=torch.bool)
    blocked[ids] = False
    return blocked
