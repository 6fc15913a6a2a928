"""Target models run by the engine: compact Llama-family code over the jakiro ops."""
from jakiro_ext.kv_cache import KVCache
from jakiro_ext.ops.masks import causal_tree_mask
from jakiro_ext.models.default import load_default_hf, load_default_target
from jakiro_ext.models.llama import LlamaConfig, LlamaModel

__all__ = ["KVCache", "LlamaConfig", "LlamaModel", "causal_tree_mask", "load_default_hf", "load_default_target"]
