"""A Llama-family GGUF file as the engine's target, its weights as the file holds them: Q4_0, Q4_1
and Q8_0 tensors packed for the CPU's integer products (:mod:`jakiro_ext.ops.quantized`: the same
blocks, rows interleaved 16 at a time, nothing requantized), float tensors in float32; the config
from the file's metadata, the tokenizer and chat template from the file (transformers' GGUF
reader). ``weights="float32"`` or ``"bfloat16"`` dequantizes instead (any GGML type gguf reads).

The model in memory is about the file's size: the packed weights are a copy of the file's blocks,
the file's mapping is let go after loading.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
from torch import nn

from jakiro_ext import ops
from jakiro_ext.memory import move_to_huge_pages
from jakiro_ext.models.llama import LlamaConfig, LlamaModel
from jakiro_ext.ops import quantized

# The weight formats a model runs in: the file's own blocks, or dequantized.
WEIGHT_FORMATS = ("file", "float32", "bfloat16")

_ARCHITECTURES = ("llama", "mistral", "qwen2")


class PackedEmbedding(nn.Module):
    """An embedding table kept packed (a quantized GGUF file's token_embd): a lookup dequantizes
    the rows it reads. ``weight`` is the packed table, shared with a tied LM head."""

    def __init__(self, packed: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(packed, requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return ops.embedding(self.weight, tokens)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader, name: str) -> LlamaConfig:
    """The model's shape from a GGUF file's metadata ({arch}.block_count, ...); a feature this
    code does not implement (RoPE scaling, an unknown architecture) is an error."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"general.architecture must be one of {_ARCHITECTURES}, got {arch!r}")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"the file gives no {arch}.{key}")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported in GGUF files (only none)")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("the file holds rope_freqs (Llama 3's RoPE scaling), not supported from GGUF files")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    tensors = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return LlamaConfig(
        vocab_size=int(embed.shape[1]), hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        qkv_bias="blk.0.attn_q.bias" in tensors, tie_word_embeddings="output.weight" not in tensors,
        sliding_window=None, max_position_embeddings=_field(reader, f"{arch}.context_length"), name=name)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows in the checkpoint's order: GGUF's converter interleaves each head's two rotary
    halves (llama.cpp's RoPE pairs adjacent values); the engine rotates halves."""
    index = np.arange(rows.shape[0]).reshape(heads, -1, 2).swapaxes(1, 2).reshape(-1)
    return rows[index]


def _tensor(reader_tensors: Dict[str, object], name: str):
    if name not in reader_tensors:
        raise ValueError(f"the file has no tensor {name!r}")
    return reader_tensors[name]


def load_gguf(path, weights: str = "file", name: Optional[str] = None) -> LlamaModel:
    """The Llama-family model of a GGUF file. ``weights``: ``"file"`` (its Q4_0 / Q4_1 / Q8_0 blocks
    as they are, see the module's docstring), ``"float32"`` or ``"bfloat16"`` (dequantized).
    ``name``: the model's name (default: the file's name up to its first dot)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    path = Path(path)
    reader = GGUFReader(str(path))
    config = read_config(reader, name or path.name.split(".")[0])
    tensors = {t.name: t for t in reader.tensors}

    def dense(t) -> torch.Tensor:  # float32 [rows, cols] (numpy's order: GGUF's dims reversed)
        values = gguf_dequantize(np.asarray(t.data), t.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            [int(n) for n in reversed(t.shape)])

    def rows_of(tname: str, heads: Optional[int] = None):
        """(GGML rows uint8 [N, bytes] and format name) or (float32 [N, K], None), q / k unpermuted."""
        t = _tensor(tensors, tname)
        packed = weights == "file" and t.tensor_type.name in quantized.FORMATS
        data = np.array(t.data) if packed else dense(t).numpy()  # (copies: the file's mapping is let go)
        if heads is not None:
            data = _unpermute(data, heads)
        return torch.from_numpy(np.ascontiguousarray(data)), t.tensor_type.name if packed else None

    def table(tname: str) -> torch.Tensor:
        """The embedding or the LM head: packed in whatever block format it is, or float32."""
        rows, format = rows_of(tname)
        return rows if format is None else quantized.pack(rows, format)

    def projection(parts) -> torch.Tensor:
        """One fused projection (rows of several tensors concatenated): packed, or float32."""
        loaded = [rows_of(n, h) for n, h in parts]
        formats = {f for _, f in loaded}
        if weights != "file":
            return torch.cat([r for r, _ in loaded])
        if None in formats or len(formats) > 1:
            kinds = ", ".join(f"{n} {_tensor(tensors, n).tensor_type.name}" for n, _ in parts)
            raise ValueError(f"weights='file' runs the projections in {'/'.join(quantized.FORMATS)} blocks, each fused "
                             f"projection in one: {kinds}; load it with weights='float32' or 'bfloat16'")
        return quantized.pack(torch.cat([r for r, _ in loaded]), formats.pop())

    with torch.device("meta"):
        model = LlamaModel(config)
    c = config
    params: Dict[str, torch.Tensor] = {}
    for i in range(c.num_layers):
        blk, layer = f"blk.{i}.", f"layers.{i}."
        params[layer + "self_attn.qkv_proj.weight"] = projection(
            [(blk + "attn_q.weight", c.num_heads), (blk + "attn_k.weight", c.num_kv_heads), (blk + "attn_v.weight", None)])
        if c.qkv_bias:
            params[layer + "self_attn.qkv_proj.bias"] = torch.cat([
                rows_of(blk + "attn_q.bias", c.num_heads)[0], rows_of(blk + "attn_k.bias", c.num_kv_heads)[0],
                rows_of(blk + "attn_v.bias")[0]])
        params[layer + "self_attn.o_proj.weight"] = projection([(blk + "attn_output.weight", None)])
        params[layer + "gate_up_proj.weight"] = projection([(blk + "ffn_gate.weight", None), (blk + "ffn_up.weight", None)])
        params[layer + "down_proj.weight"] = projection([(blk + "ffn_down.weight", None)])
        params[layer + "input_layernorm.weight"] = dense(_tensor(tensors, blk + "attn_norm.weight"))
        params[layer + "post_attention_layernorm.weight"] = dense(_tensor(tensors, blk + "ffn_norm.weight"))
    params["norm.weight"] = dense(_tensor(tensors, "output_norm.weight"))
    params["embed_tokens.weight"] = table("token_embd.weight")
    if not c.tie_word_embeddings:
        params["lm_head.weight"] = table("output.weight")
    del reader, tensors  # the file's mapping: every tensor above is a copy

    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    if quantized.is_packed(params["embed_tokens.weight"]):
        model.embed_tokens = PackedEmbedding(torch.empty(0, dtype=torch.uint8))
    for key, value in params.items():
        module_name, _, attr = key.rpartition(".")
        module = model.get_submodule(module_name)
        value = value if quantized.is_packed(value) else value.to(dtype)
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    if c.tie_word_embeddings:
        model.lm_head._parameters["weight"] = model.embed_tokens._parameters["weight"]
    model.eval()
    move_to_huge_pages(model)
    return model


def gguf_tokenizer(path):
    """The tokenizer and chat template a GGUF file holds (transformers' GGUF reader)."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
