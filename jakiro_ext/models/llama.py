"""A compact Llama-family causal LM (Llama, Mistral, Qwen2: RMSNorm, RoPE, GQA attention with
optional q/k/v bias, SwiGLU) whose attention is ``jakiro::tree_attention`` over a preallocated KV
cache, so one forward serves prefill, plain decoding and the verification of a draft tree.
Weights come from a Hugging Face transformers model (``LlamaModel.from_hf``).
"""
from __future__ import annotations

import weakref
from pathlib import Path
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from jakiro_ext import ops
from jakiro_ext.kv_cache import BufferPool, CacheShape, KVCache
from jakiro_ext.memory import in_huge_pages, move_to_huge_pages
from jakiro_ext.models.rope import LLAMA3_ROPE_KEYS, RopeTable
from jakiro_ext.models.weights import STREAM_ROWS, TargetWeights, bf16_weights_enabled, cache_dtype, exactly_bf16
from jakiro_ext.ops import reference
from jakiro_ext.ops.masks import causal_tree_mask

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None  # Mistral: caches beyond it are refused, not silently wrong
    max_position_embeddings: Optional[int] = None  # the context limit: positions the model was made for
    # Llama 3's RoPE frequency scaling ("llama3": factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None: plain RoPE.
    rope_scaling: Optional[dict] = None
    # The model's name (its directory's or hub id's last part; "" when unknown): a head made for
    # another model is named in a warning (heads.DraftHead.check_target).
    name: str = ""

    @classmethod
    def from_hf(cls, hf) -> "LlamaConfig":
        """From a transformers config of a supported model type; anything this code does not
        implement (RoPE scaling, other activations, MLP bias) is an error, never ignored."""
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"RoPE type {rope_type!r} is not supported (only 'default' and 'llama3'), in {rope}")
        scaling = None
        if rope_type == "llama3":
            missing = [k for k in LLAMA3_ROPE_KEYS if not isinstance(rope.get(k), (int, float))]
            if missing:
                raise ValueError(f"llama3 RoPE scaling needs the numbers {missing}, in {rope}")
            scaling = {k: float(rope[k]) for k in LLAMA3_ROPE_KEYS}
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
        if theta is None:
            raise ValueError("the config gives no rope_theta")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {hf.hidden_act!r}")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("MLP bias is not supported")
        qkv_bias = True if model_type == "qwen2" else bool(getattr(hf, "attention_bias", False))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        use_window = model_type == "mistral" or getattr(hf, "use_sliding_window", False)
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                   num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
                   num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads, head_dim=head_dim,
                   rope_theta=float(theta), rms_norm_eps=hf.rms_norm_eps, qkv_bias=qkv_bias,
                   tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
                   sliding_window=getattr(hf, "sliding_window", None) if use_window else None,
                   max_position_embeddings=getattr(hf, "max_position_embeddings", None), rope_scaling=scaling,
                   name=model_name(getattr(hf, "name_or_path", "") or ""))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return reference.rms_norm(x, self.weight, self.eps)[0]  # training: the fused op has no backward
        return ops.rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual) in one call (residual None: x alone)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def project(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through ``jakiro::linear``: the weight streamed once at decoding sizes, and on
    the CPU every sequence of at most 64 tokens (x [..., T, K]) computed row by row in one order
    whatever the batch, so that a sequence's result never depends on the batch it shares."""
    return ops.linear(x, layer.weight, layer.bias)


class Attention(nn.Module):
    """GQA attention's weights: q, k and v projected by one fused weight ``qkv_proj`` ([q | k | v]
    rows, as the checkpoints' three weights concatenated): one pass over the weights, one call."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.qkv_proj = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class Block(nn.Module):
    """A decoder layer's weights; gate and up are one fused weight ``gate_up_proj`` ([gate | up]
    rows). The layer runs as one ``jakiro::decoder_layer`` call."""

    def __init__(self, c: LlamaConfig, layer: int):
        super().__init__()
        self.layer, self.eps = layer, c.rms_norm_eps
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, residual, delta, cos, sin, cache: KVCache, tree_mask):
        """The residual stream is residual + delta (delta: the last sublayer's output, added here,
        fused with the norm; residual None before the first layer). Returns the new pair; the
        layer's keys and values go into ``cache`` after each sequence's committed prefix."""
        return self.run(residual, delta, cos, sin, cache.kv[self.layer], cache.lengths, tree_mask)

    def run(self, residual, delta, cos, sin, layer_kv, lengths, tree_mask, projections=None):
        """:meth:`forward` with this layer's slice of the cache given, and the weights read from
        the modules' dicts: ``module.attr`` of a submodule or parameter raises and catches an
        AttributeError inside nn.Module before finding it (about a microsecond each, fourteen a
        layer: about 0.35 ms of a decoding step at the default model's 30 layers).
        ``projections``: the (qkv, o, gate_up, down) weights to read instead of the parameters
        (:meth:`LlamaModel.streamed_weights`)."""
        mods = self._modules
        w_qkv, w_o, w_gate_up, w_down = projections or self.projections()
        return ops.decoder_layer(delta, residual, mods["input_layernorm"]._parameters["weight"], w_qkv,
                                 mods["self_attn"]._modules["qkv_proj"]._parameters["bias"], w_o,
                                 mods["post_attention_layernorm"]._parameters["weight"], w_gate_up, w_down,
                                 cos, sin, layer_kv, lengths, tree_mask, self.eps)

    def projections(self) -> Tuple[torch.Tensor, ...]:
        """The (qkv, o, gate_up, down) weight parameters, read from the modules' dicts (see :meth:`run`)."""
        mods = self._modules
        attn = mods["self_attn"]._modules
        return (attn["qkv_proj"]._parameters["weight"], attn["o_proj"]._parameters["weight"],
                mods["gate_up_proj"]._parameters["weight"], mods["down_proj"]._parameters["weight"])


# A prompt (a chain of tokens) longer than this runs as chunks of this many tokens
# (LlamaModel.prefill_chunk; 0: one forward): measured on a 2-core Xeon, fp32, see docs/benchmarks.md.
PREFILL_CHUNK = 512


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.prefill_chunk = PREFILL_CHUNK
        self._rope_table = RopeTable(config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def activation_dtype(self) -> torch.dtype:
        """The activations' dtype (the KV cache's: :func:`~jakiro_ext.models.weights.cache_dtype`):
        the weights', float32 beside packed quantized ones (a GGUF file's, :mod:`.gguf`)."""
        return self.norm.weight.dtype

    def new_cache(self, batch: int, capacity: int, max_capacity: Optional[int] = None, pool: Optional[BufferPool] = None):
        """A KV cache of ``capacity`` positions per sequence, growing up to ``max_capacity`` (default:
        fixed), sized by and made of the buffers of ``pool`` (:class:`KVCache`)."""
        c, weight = self.config, self.layers[0].projections()[0]
        return KVCache(CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, c.sliding_window), batch, capacity,
                       cache_dtype(self.activation_dtype, weight), weight.device, max_capacity, pool)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: KVCache, tree_mask: Optional[torch.Tensor] = None,
                depths: Optional[torch.Tensor] = None, last_logits_only: bool = False,
                feature_layers: Optional[Sequence[int]] = None,
                weights: Optional[TargetWeights] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run T new tokens per sequence after each one's committed prefix.

        Parameters
        ----------
        tokens : [B, T] int64.
        cache : their keys/values are written at [lengths[b], lengths[b] + T) (the cache grows
            when it must); ``cache.lengths`` is not advanced (the caller commits what it keeps).
        tree_mask : [B, T, ceil(T/64)] bit-packed ancestor mask; default causal (a chain).
        depths : [B, T] int64 depth of each token in its tree (position = length + depth);
            default 0..T-1 (a chain).
        last_logits_only : compute the logits of the last token only (a prompt's prefill).
        feature_layers : return, instead of the final hidden states, the residual streams entering
            these layers, concatenated [B, T, len * H] (an EAGLE-3 head's input); L, the number of
            layers: the stream after the last one, before the final norm.
        weights : what the forward reads of the weights (:meth:`prepare`, made once for many
            forwards); default: prepared for this forward.

        Returns
        -------
        logits [B, T, V] (or [B, 1, V]) and the final hidden states [B, T, H] (after the final norm).
        """
        B, T = tokens.shape
        if tokens.dim() != 2 or B != cache.lengths.shape[0]:
            raise ValueError(f"tokens must be [B, T] with B = {cache.lengths.shape[0]} (the cache's batch), "
                             f"got {tuple(tokens.shape)}")
        longest = max(cache.host_lengths) + T
        if longest > cache.max_capacity:
            raise ValueError(f"{T} new tokens after a prefix of {max(cache.host_lengths)} need {longest} cache "
                             f"positions, beyond the cache capacity {cache.max_capacity}")
        cache.reserve(longest)
        weights = self.prepare() if weights is None else weights
        streamed = weights.streamed if B * (1 if last_logits_only else T) <= STREAM_ROWS else None
        if tree_mask is None and depths is None and 0 < self.prefill_chunk < T:
            normed, hidden = self._chunked(tokens, cache, feature_layers, weights)
        else:
            normed, hidden = self._layers(tokens, cache, tree_mask, depths, feature_layers, weights,
                                          B * T <= STREAM_ROWS)
        last = normed[:, -1:] if last_logits_only else normed
        return (project(self.lm_head, last) if streamed is None else ops.linear(last, streamed[-1])), hidden

    def prepare(self) -> TargetWeights:
        """What this model's forwards read of its weights, as they are now (:class:`TargetWeights`)."""
        streamed = self.streamed_weights()
        return TargetWeights(self._layer_weights(), streamed,
                             None if streamed is None else self._layer_weights(streamed))

    def streamed_weights(self) -> Optional[list]:
        """What the streamed products (decoding, a tree's verification: at most STREAM_ROWS rows)
        read instead of the float32 parameters, on the CPU, where every projection and LM-head
        weight is exactly a bf16 value (a bf16 checkpoint loaded in float32): bf16 copies, in huge
        pages, [(qkv, o, gate_up, down) per layer, then the LM head], which the products widen in
        registers (the same bits, half the bytes; the parameters stay, for BLAS). Made once and
        made again when a parameter changes (its version or storage); None: read the parameters
        (another dtype or device, a weight not exactly bf16, ``JAKIRO_CPU_BF16_WEIGHTS=0``)."""
        head = self._modules["lm_head"]._parameters["weight"]  # (a GGUF file's packed: None at once)
        if not bf16_weights_enabled() or head.dtype != torch.float32 or head.device.type != "cpu":
            return None
        kept = self.__dict__.get("_bf16_weights")
        params = [p for layer in self._modules["layers"]._modules.values() for p in layer.projections()]
        params.append(head)
        key = [(p.data_ptr(), p._version) for p in params]
        if kept is not None and kept[0] == key:
            return kept[1]
        copies = None
        if all(exactly_bf16(p) for p in params):
            with torch.no_grad():
                flat = in_huge_pages([p.detach().bfloat16() for p in params])
            copies = [tuple(flat[i: i + 4]) for i in range(0, len(flat) - 1, 4)] + [flat[-1]]
        self.__dict__["_bf16_weights"] = (key, copies)
        return copies

    def _layers(self, tokens: torch.Tensor, cache: KVCache, tree_mask: Optional[torch.Tensor],
                depths: Optional[torch.Tensor], feature_layers: Optional[Sequence[int]], weights: TargetWeights,
                stream: bool = False):
        """(the final hidden states after the norm, what the forward returns as hidden states);
        ``stream``: read the bf16 copies of ``weights`` where it has them."""
        streamed = weights.streamed if stream else None
        B, T = tokens.shape
        device = tokens.device
        if tree_mask is None:
            tree_mask = causal_tree_mask(B, T, device)
        if depths is None:
            depths = torch.arange(T, device=device).expand(B, T)
        cos, sin = self._rope(cache.lengths.unsqueeze(1) + depths, cache.capacity)
        residual, delta = None, self.embed_tokens(tokens)
        lists = weights.lists if streamed is None else weights.streamed_lists
        if feature_layers is None:  # every layer in one call
            residual, delta = ops.decoder_layers(delta, None, *lists, cos, sin, cache.kv,
                                                 cache.lengths, tree_mask, self.config.rms_norm_eps)
            normed, _ = self.norm.add_and_norm(delta, residual)
            return normed, normed
        # One call per run of layers between the collected ones (the stream entering each): one call's arithmetic.
        L, streams, start = len(self.layers), {}, 0
        for stop in sorted({i for i in feature_layers if 0 < i < L}) + [L]:
            if start in feature_layers:
                streams[start] = delta if residual is None else residual + delta
            residual, delta = ops.decoder_layers(delta, residual, *(part[start:stop] for part in lists), cos, sin,
                                                 cache.kv[start:stop], cache.lengths, tree_mask,
                                                 self.config.rms_norm_eps)
            start = stop
        normed, streams[L] = self.norm.add_and_norm(delta, residual)  # (L: the stream after the last layer, before the norm)
        return normed, torch.cat([streams[i] for i in feature_layers], -1)

    def _layer_weights(self, streamed: Optional[list] = None) -> tuple:
        """``jakiro::decoder_layers``' lists of the layers' weights (input_norms, qkv_weights,
        qkv_biases, o_weights, post_norms, gate_up_weights, down_weights), read from the modules'
        dicts (see :meth:`Block.run`); ``streamed``: the projections to read instead
        (:meth:`streamed_weights`)."""
        blocks = list(self._modules["layers"]._modules.values())
        projections = streamed[:-1] if streamed is not None else [b.projections() for b in blocks]
        biases = [b._modules["self_attn"]._modules["qkv_proj"]._parameters["bias"] for b in blocks]
        qkv, o, gate_up, down = zip(*projections)
        return ([b._modules["input_layernorm"]._parameters["weight"] for b in blocks], list(qkv),
                biases if biases[0] is not None else [], list(o),
                [b._modules["post_attention_layernorm"]._parameters["weight"] for b in blocks], list(gate_up),
                list(down))

    def _chunked(self, tokens: torch.Tensor, cache: KVCache, feature_layers: Optional[Sequence[int]],
                 weights: TargetWeights):
        """:meth:`_layers` of a chain longer than ``prefill_chunk`` (a prompt) as consecutive runs of
        at most ``prefill_chunk`` tokens, each after the ones before: the attention of a chunk reads
        the earlier ones as its prefix, and only its own tokens as a tree, so the work and scratch
        memory of the tree part stay those of one chunk. The cache ends as one forward leaves it
        (the keys and values written, none committed)."""
        chunk, T = self.prefill_chunk, tokens.shape[1]
        normed, hidden, done = [], [], 0
        try:
            for start in range(0, T, chunk):
                part = tokens[:, start: start + chunk]
                part_normed, part_hidden = self._layers(part, cache, None, None, feature_layers, weights)
                normed.append(part_normed)
                hidden.append(part_hidden)
                if start + chunk < T:
                    cache.commit(part.shape[1])
                    done += part.shape[1]
        finally:
            if done:
                cache.commit(-done)
        normed = torch.cat(normed, 1)
        return normed, normed if feature_layers is None else torch.cat(hidden, 1)

    def _rope(self, positions: torch.Tensor, capacity: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] at positions [B, T] (< capacity), from the model's :class:`RopeTable`."""
        return self._rope_table(positions, capacity, self.activation_dtype)

    @classmethod
    def from_hf(cls, hf_model, dtype: Optional[torch.dtype] = None) -> "LlamaModel":
        """The same network as a transformers ``*ForCausalLM`` of a supported type, weights copied
        (on the CPU into huge pages: :func:`jakiro_ext.memory.move_to_huge_pages`)."""
        config = LlamaConfig.from_hf(hf_model.config)
        model = cls(config)
        src = hf_model.state_dict()

        def weight(hf_name: str) -> torch.Tensor:
            if hf_name not in src:
                raise KeyError(f"no weight {hf_name!r} in the transformers model")
            return src[hf_name]

        # Our names -> the checkpoint's (several: concatenated along the output rows).
        fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}
        dst = {}
        for name in model.state_dict():
            if name == "lm_head.weight":
                dst[name] = weight("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
                continue
            module, _, kind = name.rpartition(".")  # kind: weight or bias
            if module.startswith("layers."):  # layers.<i>.<local> -> model.layers.<i>.<checkpoint names>
                _, index, local = module.split(".", 2)
                prefix = f"model.layers.{index}."
            else:  # embed_tokens, norm
                local, prefix = module, "model."
            dst[name] = torch.cat([weight(f"{prefix}{part}.{kind}") for part in fused.get(local, (local,))])
        model.load_state_dict(dst)
        model = model.to(dtype or next(hf_model.parameters()).dtype).eval()
        move_to_huge_pages(model)  # on the CPU: the decoding weight stream reads faster from 2 MiB pages
        return model


_CONVERTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transformers model -> LlamaModel


def model_name(name_or_path: str) -> str:
    """A model's name from its hub id or directory: the last part (``HuggingFaceTB/SmolLM2-135M``
    and ``/models/SmolLM2-135M/`` are both ``SmolLM2-135M``)."""
    return Path(str(name_or_path).rstrip("/\\")).name


def as_target(model) -> LlamaModel:
    """The engine's target for ``model``: a :class:`LlamaModel` as it is, or a transformers causal
    LM of a supported family (``SUPPORTED_MODEL_TYPES``), converted once on its device and in its
    dtype (:meth:`LlamaModel.from_hf`: the weights copied into the fused layout) and cached for as
    long as the transformers model lives, so its heads and later calls share the conversion.
    Change the transformers model's weights afterwards and the conversion no longer follows them."""
    if isinstance(model, LlamaModel):
        return model
    if not (isinstance(model, nn.Module) and hasattr(model, "config") and type(model).__name__.endswith("ForCausalLM")):
        raise TypeError(f"target must be a LlamaModel or a transformers *ForCausalLM of a supported family "
                        f"{SUPPORTED_MODEL_TYPES}, got {type(model).__name__}")
    converted = _CONVERTED.get(model)
    if converted is None:
        device = next(model.parameters()).device
        converted = _CONVERTED[model] = LlamaModel.from_hf(model).to(device)
    return converted

