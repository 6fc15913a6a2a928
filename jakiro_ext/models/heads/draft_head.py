"""EAGLE-style draft heads: decoder layers over ``fc(cat(embed(token_{t+1}), f_t))``, where f_t is
the target's final hidden state, predicting f_{t+1}. The embedding and the LM head are the
target's (shared, never stored with the head). The feed-forward block is

- ``num_experts == 0``: a dense SwiGLU MLP (the EAGLE-2 baseline);
- ``num_experts >= 2``: Jakiro's MoE, router ``[N + 2, H]``, top-2 slim SwiGLU experts, run by the
  fused ``jakiro::moe_top2`` op. Besides the MoE feature it yields the contrastive feature used for
  the parallel last draft step, and the two per-expert features of the decoupled (Jakiro*) tree.

Gumiho heads (``num_mlp_heads >= 1``, Li et al. 2025) add parallel MLP heads after the serial
layers (``num_layers``, 2 in the released heads): head j maps ``cat(x_parent, x_leaf)``, the ``fc``
outputs of a draft leaf's parent and of the leaf itself, to the feature j + 1 tokens past the
leaf, ``SiLU(W_in x + b)`` then ``mlp_blocks`` residual blocks ``h + SiLU(W h + b)``. All heads read
the same input: one pass drafts every later layer of the tree.

A fused head (``feature_layers``, three target layer ids) reads at a committed token, in place of
f_t, ``fuse(cat(h_low, h_mid, h_high))`` (EAGLE-3's ``fc``: [H, 3H], no bias), the streams
entering those target layers; a drafted token's feature is still the head's own output; either
goes through ``hidden_norm`` (EAGLE-3's) before ``fc``. Trained
as EAGLE-3 trains (the token loss alone, unrolled), it is EAGLE-2's or Jakiro's layer on EAGLE-3's
features; it is saved in this package's format only.

Layout as in the released EAGLE/Jakiro/Gumiho code: no norm before layer 0's attention, an
RMSNorm before every later layer's, RMSNorm after each attention, no final norm; ``fc`` has a
bias; the embedding comes first in the concat. Layer 0's weights are the head's own attributes
(the EAGLE names), later layers are ``layers.{i}``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from jakiro_ext import ops
from jakiro_ext.kv_cache import BufferPool, KVCache, TreeKV
from jakiro_ext.memory import memory_errors
from jakiro_ext.models.heads import formats as head_formats
from jakiro_ext.models.heads.config import (ACCEPTANCE_FILE, DraftConfig, read_acceptance,
                                            write_head_files)
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.heads import drafting
from jakiro_ext.models.heads.drafting import Products
from jakiro_ext.models.heads.head import Head, check_target_of, check_target_shapes, load_checked_state, new_head_cache
from jakiro_ext.models.llama import LlamaModel, RMSNorm, as_target, project
from jakiro_ext.ops import quantized


def _add_layer_weights(module: nn.Module, c: DraftConfig, dense: bool = True) -> None:
    """A decoder layer's attention projections, post-attention norm and (``dense``) SwiGLU MLP."""
    H = c.hidden_size
    module.q_proj = nn.Linear(H, c.num_heads * c.head_dim, bias=False)
    module.k_proj = nn.Linear(H, c.num_kv_heads * c.head_dim, bias=False)
    module.v_proj = nn.Linear(H, c.num_kv_heads * c.head_dim, bias=False)
    module.o_proj = nn.Linear(c.num_heads * c.head_dim, H, bias=False)
    module.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
    if dense:
        module.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        module.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        module.down_proj = nn.Linear(c.intermediate_size, H, bias=False)


class DraftLayer(nn.Module):
    """A serial layer after the first: RMSNorm, attention, RMSNorm, dense SwiGLU MLP."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        _add_layer_weights(self, config)


class DraftHead(nn.Module):
    def __init__(self, config: DraftConfig, init: bool = True):
        """``init``: random weights (:meth:`init_weights`, seed 0); False leaves the tensors unset,
        for a loader that fills every one of them."""
        super().__init__()
        c = self.config = config
        H = c.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        if c.feature_layers:  # EAGLE-3's fc and hidden_norm
            self.fuse = nn.Linear(3 * H, H, bias=False)
            self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        # What the engine asks the target for (None: its final hidden states).
        self.feature_layers = tuple(c.feature_layers) or None
        _add_layer_weights(self, c, dense=not c.num_experts)
        if c.num_experts:
            N, inner = c.num_experts, c.intermediate_size
            self.router = nn.Parameter(torch.empty(N + 2, H))
            self.w_gate = nn.Parameter(torch.empty(N, inner, H))
            self.w_up = nn.Parameter(torch.empty(N, inner, H))
            self.w_down = nn.Parameter(torch.empty(N, H, inner))
        if c.num_layers > 1:
            self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers - 1))
        if c.num_mlp_heads:  # stacked over heads and blocks, as jakiro::mlp_heads takes them
            J = c.num_mlp_heads
            self.mlp_in_weight = nn.Parameter(torch.empty(J, H, 2 * H))
            self.mlp_in_bias = nn.Parameter(torch.empty(J, H))
            self.mlp_block_weight = nn.Parameter(torch.empty(J, c.mlp_blocks, H, H))
            self.mlp_block_bias = nn.Parameter(torch.empty(J, c.mlp_blocks, H))
        if c.draft_vocab_size:
            # Draft token d is target token draft_to_target[d]; stored with the head.
            self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size, dtype=torch.int64))
        self.embed_weight: Optional[torch.Tensor] = None  # the target's, set by bind()
        self.lm_head_weight: Optional[torch.Tensor] = None  # the target's rows of the draft vocabulary
        self.packed_lm_head: Optional[torch.Tensor] = None  # ... packed, a quantized target's (bind)
        # How often its drafts are accepted, by depth and rank (jakiro_ext.engine.tree_cost; acceptance.json)
        self.acceptance: Optional[dict] = None
        if init:  # (never torch.empty's leftovers: a new head drafts, if badly, until trained)
            self.init_weights()

    # ------------------------------------------------------------------ construction and storage
    def init_weights(self, seed: int = 0, std: float = 0.02) -> "DraftHead":
        """Random weights (normal(0, std), zero biases, unit norm weights; the MLP heads'
        residual blocks zero, as released: each head starts as its input layer), reproducible by
        seed. A new head has them (seed 0); call it again for another seed or scale."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias") or name == "mlp_block_weight":
                    p.zero_()
                elif name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    @torch.no_grad()
    def init_from_target(self, target: LlamaModel) -> "DraftHead":
        """Start from the target's own last layers instead of random weights: serial layer i is a
        copy of target layer ``L - num_layers + i`` (attention, post-attention norm, and the MLP:
        whole for a dense head of the target's width, or cut into the experts, expert j the j-th
        slice of its rows, for a MoE head); ``fc`` passes the feature through (``[0 | I]``, the
        embedding's half zero), so the head starts as the target's last layer applied to f_t.
        The router and the MLP heads keep their (random) weights."""
        target = as_target(target)
        c, t = self.config, target.config
        if c.feature_layers:
            raise ValueError(f"init_from_target starts a head as the target's last layer on f_t; this head reads target "
                             f"layers {c.feature_layers} fused (start it from random weights)")
        if c.hidden_size != t.hidden_size or c.num_heads != t.num_heads or c.num_kv_heads != t.num_kv_heads \
                or c.head_dim != t.head_dim:
            raise ValueError("init_from_target: the head's attention geometry differs from the target's")
        width = c.intermediate_size * (c.num_experts or 1)
        if width != t.intermediate_size:
            raise ValueError(f"init_from_target: the head's MLP ({c.num_experts or 1} x {c.intermediate_size}) is not "
                             f"the target's ({t.intermediate_size}) wide")
        if c.num_layers > len(target.layers):
            raise ValueError(f"init_from_target: {c.num_layers} serial layers, the target has {len(target.layers)}")
        H, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc.weight.zero_()
        self.fc.weight[:, H:].copy_(torch.eye(H))
        self.fc.bias.zero_()
        mine = [self] + list(self.layers if c.num_layers > 1 else [])
        for w, block in zip(mine, target.layers[len(target.layers) - c.num_layers:]):
            qkv = block.self_attn.qkv_proj.weight
            w.q_proj.weight.copy_(qkv[:q])
            w.k_proj.weight.copy_(qkv[q: q + kv])
            w.v_proj.weight.copy_(qkv[q + kv: q + 2 * kv])
            w.o_proj.weight.copy_(block.self_attn.o_proj.weight)
            w.post_attention_layernorm.weight.copy_(block.post_attention_layernorm.weight)
            if w is not self and hasattr(w, "input_layernorm"):
                w.input_layernorm.weight.copy_(block.input_layernorm.weight)
            gate, up = block.gate_up_proj.weight.split(t.intermediate_size)
            down = block.down_proj.weight
            if c.num_experts:
                n = c.intermediate_size
                for j in range(c.num_experts):
                    self.w_gate[j].copy_(gate[j * n: (j + 1) * n])
                    self.w_up[j].copy_(up[j * n: (j + 1) * n])
                    self.w_down[j].copy_(down[:, j * n: (j + 1) * n])
            else:
                w.gate_proj.weight.copy_(gate)
                w.up_proj.weight.copy_(up)
                w.down_proj.weight.copy_(down)
        return self

    def set_draft_vocab(self, target_ids: torch.Tensor) -> "DraftHead":
        """Draft over these target token ids only (a reduced vocabulary: a cheaper LM-head pass).
        Call before :meth:`bind`. The drafted tokens are always target ids, so verification, and
        with it losslessness, is unaffected; a token outside the set is just never drafted."""
        c = self.config
        ids = torch.as_tensor(target_ids, dtype=torch.int64).flatten()
        if not c.draft_vocab_size or ids.numel() != c.draft_vocab_size:
            raise ValueError(f"this head's config has draft_vocab_size {c.draft_vocab_size}; got {ids.numel()} token ids")
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"draft vocabulary ids must be distinct target ids in [0, {c.vocab_size})")
        self.draft_to_target.copy_(ids)
        return self

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (the identity without a reduced vocabulary)."""
        return self.draft_to_target[draft_ids] if self.config.draft_vocab_size else draft_ids

    def check_target(self, target: LlamaModel) -> None:
        """A head made for another target is an error, or a warning when only its name differs
        (:func:`jakiro_ext.models.heads.head.check_target_shapes`), and so is a fused head whose
        layers the target does not have."""
        check_target_shapes(self.config, target)
        layers = as_target(target).config.num_layers
        if any(i > layers for i in self.config.feature_layers):  # (L: the stream after the last layer)
            raise ValueError(f"the draft head reads the streams entering target layers {self.config.feature_layers}, "
                             f"but the target has {layers} layers (ids 0..{layers}, {layers}: after the last)")

    def bind(self, target: LlamaModel) -> "DraftHead":
        """Share the target's embedding and LM head (its draft-vocabulary rows); a head made for
        another target is an error. ``target``: a LlamaModel or a transformers causal LM (:func:`as_target`)."""
        target = as_target(target)
        self.check_target(target)
        c = self.config
        self.embed_weight = target.embed_tokens.weight.detach()  # shared, frozen (a GGUF target's may be packed)
        lm_head = target.lm_head.weight.detach()
        device = lm_head.device
        draft_ids = self.draft_to_target.to(device) if c.draft_vocab_size else None
        self.packed_lm_head = None
        if quantized.is_packed(lm_head):  # a GGUF target's: its rows of the draft vocabulary dequantized,
            if draft_ids is None or draft_ids.numel() % quantized.LANES == 0:  # and as they are (drafting_products)
                self.packed_lm_head = lm_head if draft_ids is None else quantized.select_rows(lm_head, draft_ids)
            lm_head = quantized.dequantize(lm_head) if draft_ids is None else ops.dequantize_rows(lm_head, draft_ids)
        elif draft_ids is not None:
            lm_head = lm_head[draft_ids].contiguous()  # [V_draft, H], not a parameter
        self.lm_head_weight = lm_head
        return self.to(dtype=target.activation_dtype, device=device)

    def save(self, path, dtype: Optional[torch.dtype] = None, metadata: Optional[dict] = None,
             format: str = "jakiro_ext", full_vocabulary: bool = False, extra_files: Optional[dict] = None) -> None:
        """``config.json`` plus ``model.safetensors`` (the head's own weights, in ``dtype`` if
        given, and the draft vocabulary), and ``acceptance.json`` when the head has a profile;
        ``metadata`` (str -> str) goes into the file's header; ``extra_files`` (name -> text, e.g.
        ``training.json``) are written with them. The directory is replaced atomically: a kill
        leaves the old head or the new one, never a mix, and no file of the old head survives.
        ``format="eagle"``: a dense head in the EAGLE-1/2 format of vLLM's and SGLang's ``eagle``
        (:func:`jakiro_ext.models.heads.formats.eagle_files`; a reduced draft vocabulary needs
        ``full_vocabulary=True``); ``"serving"``: for this package's plugins (:mod:`jakiro_ext.serving`)."""
        if format == "eagle3":
            raise ValueError("the eagle3 format holds EAGLE-3 heads (three target layers in, their own LM head); "
                             f"this head is {self.config.kind}: save it as 'eagle'")
        if format not in ("jakiro_ext", "eagle", "serving"):
            raise ValueError(f"format must be 'jakiro_ext', 'eagle' or 'serving', got {format!r}")
        config, state = head_formats.HEAD_FORMATS[format].write(self, full_vocabulary)
        extra = dict(extra_files or {})
        if self.acceptance is not None and format == "jakiro_ext":
            extra[ACCEPTANCE_FILE] = json.dumps(self.acceptance, indent=1) + "\n"
        write_head_files(path, config, state, dtype, {"kind": self.config.kind, **(metadata or {})}, extra)

    @classmethod
    def load(cls, path, target: Optional[LlamaModel] = None, format: Optional[str] = None) -> Head:
        with memory_errors(f"loading the draft head {path}"):
            return cls._load(path, target, format)

    @classmethod
    def _load(cls, path, target: Optional[LlamaModel], format: Optional[str]) -> Head:
        """Load a head (and bind it to ``target`` when given): saved by this package, or released
        in the EAGLE-1/2, Jakiro or EAGLE-3 format (:mod:`jakiro_ext.models.heads.formats`), recognised from
        its config and weight names (``format=`` forces one of ``head_formats.FORMATS``). A missing
        file is a FileNotFoundError, a malformed one or one that does not match its format or
        the target a ValueError, each naming the file and the key or shape."""
        path = Path(path)
        target = None if target is None else as_target(target)
        head_formats.check_head_directory(path)
        if format is not None and format not in head_formats.FORMATS:
            raise ValueError(f"format must be one of {head_formats.FORMATS}, got {format!r}")
        raw = head_formats.read_config(path)
        weights = None
        if format is None:
            format, weights = head_formats.recognise(path, raw)
        head = head_formats.HEAD_FORMATS[format].read(cls, path, raw, lambda h: check_target_of(h, target, path),
                                                      weights)
        if (path / ACCEPTANCE_FILE).is_file():
            head.acceptance = read_acceptance(path / ACCEPTANCE_FILE)
        head.eval()
        if target is None:
            return head
        head = head.bind(target)
        # Bound to decode: drafting's weight copies made now, not in the first tree round of the
        # first call (7.5 ms beside the quantized default model, 3% of a 64-token call, which the
        # live choice counted as the cost of switching to a tree).
        head.products()
        return head

    def load_checked_state(self, state: dict, weights: Path) -> None:
        """Load ``state`` after checking that it fits this head (:func:`head.load_checked_state`),
        and its draft vocabulary."""
        load_checked_state(self, state, weights)
        if self.config.draft_vocab_size:
            try:
                self.set_draft_vocab(self.draft_to_target.clone())
            except ValueError as exc:
                raise ValueError(f"{weights}: draft_to_target: {exc}") from None

    def products(self) -> Products:
        """What drafting's products read (:func:`jakiro_ext.models.heads.drafting.drafting_products`)."""
        return drafting.drafting_products(self)

    def new_cache(self, capacity: int, max_capacity: Optional[int] = None, batch: int = 1,
                  pool: Optional[BufferPool] = None) -> KVCache:
        """A KV cache of ``capacity`` positions per sequence, growing on demand up to ``max_capacity``
        (default: fixed)."""
        return new_head_cache(self.config, self.fc.weight, capacity, max_capacity, batch, pool)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor, ancestors: Optional["TreeKV"] = None) -> DraftStep:
        """One draft forward over T new rows.

        Parameters
        ----------
        tokens : [B, T] int64, token_{t+1} of each row.
        features : [B, T, H], f_t of each row (the target's, or a draft-predicted one); a fused
            head's committed rows: the target's three layers [B, T, 3H].
        positions : [B, T] int64 RoPE positions.
        cache : the draft's KV cache. The rows' keys/values are written at
            [lengths, lengths + T) (the cache grows when it must; not committed: the caller
            advances ``cache.lengths``).
        tree_mask : [B, T, ceil(T / 64)] which new rows each row sees (a chain: causal; one tree
            layer: itself only), besides the whole committed prefix.
        ancestors : keys/values of earlier draft-tree layers and which of them each row sees;
            their attention is merged with the prefix's by log-sum-exp (split-KV style).
        """
        c = self.config
        products = self.products()

        def attention(weights: nn.Module, x: torch.Tensor, layer: int) -> torch.Tensor:
            return drafting.attention(self, x, positions, cache, tree_mask, ancestors, layer, weights, products)

        def moe(normed: torch.Tensor):
            _, expert_out, _, score, contrast = ops.moe_top2(normed, self.router, *products.experts, c.renormalize)
            return expert_out, score, contrast

        return self.run_layers(self.project_input(tokens, features, products=products), attention,
                            lambda w, x: drafting.mlp(self, x, w, products), moe)

    def run_layers(self, x: torch.Tensor, attention: Callable, mlp: Callable, moe: Callable) -> DraftStep:
        """The head's layers on the projected input x [B, T, H]: the one definition drafting and
        training share. ``attention(weights, x, layer)``, ``mlp(weights, x)`` and ``moe(normed) ->
        (expert_out [B, T, 2, H], score [B, T, 2], contrast)`` are how each runs its parts."""
        c = self.config
        projected = x if c.num_mlp_heads else None
        u = x + attention(self, x, 0)
        normed = self.post_attention_layernorm(u)
        if c.num_experts:
            expert_out, score, contrast = moe(normed)
            # The layer's residual is u (moe_top2's own residual output, the normed u, is not used).
            feature = u + (score.unsqueeze(-1).to(u.dtype) * expert_out).sum(-2)
            return DraftStep(feature, u, expert_out, score, contrast, projected=projected)
        h = u + mlp(self, normed)
        for i, layer in enumerate(self.layers if c.num_layers > 1 else (), 1):
            u = h + attention(layer, layer.input_layernorm(h), i)
            h = u + mlp(layer, layer.post_attention_layernorm(u))
        return DraftStep(h, u, projected=projected)

    def project_input(self, tokens: torch.Tensor, features: torch.Tensor, train: bool = False,
                      products: Optional[Products] = None) -> torch.Tensor:
        """``fc(cat(embed(tokens), features))``: rows [..., H] of the serial layers' input (with
        ``train``, in plain PyTorch: the fused linear has no backward; else reading :meth:`products`).
        A fused head's features may be the target's three layers [..., 3H], fused first; its feature
        (fused, or its own output at a drafted token) is normalised (EAGLE-3's hidden_norm: the
        layers' raw residual streams, and the outputs fed back, are far from the final state's scale)."""
        features = features.to(self.fc.weight.dtype)
        if self.feature_layers:
            if features.shape[-1] == 3 * self.config.hidden_size:
                features = self.fuse(features) if train else project(self.fuse, features)
            features = self.hidden_norm(features)
        x = torch.cat([ops.embedding(self.embed_weight, tokens), features], -1)
        if train:
            return self.fc(x)
        return ops.linear(x, (products or self.products()).fc, self.fc.bias)

    def mlp_heads(self, x: torch.Tensor, train: bool = False) -> torch.Tensor:
        """Gumiho's parallel MLP heads on x [..., 2H] (``cat(x_parent, x_leaf)``): features
        [..., J, H], head j's the one j + 1 tokens past the leaf. Drafting runs them as one fused
        ``jakiro::mlp_heads`` call (each row computed alike whatever the number of rows, so a
        sequence drafts the same inside a batch); ``train``: the same math in plain PyTorch,
        differentiable (the op has no backward)."""
        c = self.config
        x = x.to(self.mlp_in_weight.dtype)
        if not train:
            return ops.mlp_heads(x, self.mlp_in_weight, self.mlp_in_bias, self.mlp_block_weight, self.mlp_block_bias)
        outs = []
        for j in range(c.num_mlp_heads):  # (under autocast the products in bf16, the residual stream not)
            h = F.silu(F.linear(x, self.mlp_in_weight[j], self.mlp_in_bias[j])).to(x.dtype)
            for b in range(c.mlp_blocks):
                h = h + F.silu(F.linear(h, self.mlp_block_weight[j, b], self.mlp_block_bias[j, b]))
            outs.append(h)
        return torch.stack(outs, -2)
