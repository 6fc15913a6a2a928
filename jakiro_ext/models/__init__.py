"""Target models run by the engine: compact Llama-family code over the jakiro ops."""
from jakiro_ext.models.default import load_default_hf, load_default_target
from jakiro_ext.models.llama import KVCache, LlamaConfig, LlamaModel, causal_tree_mask

__all__ = ["KVCache", "LlamaConfig", "LlamaModel", "causal_tree_mask", "load_default_hf", "load_default_target"]
