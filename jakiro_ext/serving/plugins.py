"""The engines' entry points (setup.py): ``vllm.general_plugins`` -> :func:`register_vllm`,
``sglang.srt.plugins`` -> :func:`register_sglang`. Each engine calls them in every one of its
processes; they register the draft class of the serving format (:data:`ARCHITECTURE`) and do
nothing else, so installing this package changes nothing for other models.

The classes subclass the engines' EAGLE drafts and rely on a few of their internals (the hooks
below). Registration checks them: where one is missing (another engine version) it warns, and
the class's module raises the same message when the engine loads a serving-format head, instead of
failing somewhere inside the engine.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import warnings
from typing import Dict, List, Tuple

from jakiro_ext.serving.format import ARCHITECTURE

SUPPORTED = {"vllm": ("0.32.0",), "sglang": ("0.5.23",)}  # the versions whose sources the classes follow
# "module:attribute" -> the parameters its signature must have (empty: only that it exists)
HOOKS: Dict[str, Dict[str, Tuple[str, ...]]] = {
    "vllm": {
        "vllm:ModelRegistry": (),
        "vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM": (),
        "vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM.__init__": ("vllm_config", "prefix"),
        "vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM.forward":
            ("input_ids", "positions", "hidden_states", "inputs_embeds"),
        "vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM.compute_logits": ("hidden_states",),
        "vllm.model_executor.models.llama:LlamaDecoderLayer.forward": ("positions", "hidden_states", "residual"),
        "vllm.model_executor.layers.linear:ReplicatedLinear.__init__":
            ("input_size", "output_size", "bias", "params_dtype", "prefix", "return_bias"),
        "vllm.model_executor.model_loader.weight_utils:default_weight_loader": ("param", "loaded_weight"),
        "vllm.model_executor.models.utils:maybe_prefix": (),
    },
    "sglang": {
        "sglang.srt.models.registry:ModelRegistry": (),
        "sglang.srt.models.llama_eagle:LlamaForCausalLMEagle.__init__": ("config", "quant_config", "prefix"),
        "sglang.srt.models.llama:LlamaForCausalLM.forward": ("input_ids", "positions", "forward_batch"),
        "sglang.srt.models.llama:LlamaDecoderLayer.forward": ("positions", "hidden_states", "forward_batch"),
        "sglang.srt.model_loader.weight_utils:default_weight_loader": ("param", "loaded_weight"),
        "sglang.srt.distributed:get_tensor_model_parallel_world_size": (),
    },
}
VLLM_CLASS = "jakiro_ext.serving.vllm_draft:EagleJakiroLlamaForCausalLM"
SGLANG_PACKAGE = "jakiro_ext.serving.sglang_models"


def missing_hooks(engine: str) -> List[str]:
    """What of ``engine``'s internals the draft class relies on is not there (empty: all is)."""
    missing = []
    for hook, params in HOOKS[engine].items():
        module, _, path = hook.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{hook} ({type(exc).__name__}: {exc})")
            continue
        if params:
            try:
                have = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                have = {}
            lacking = [p for p in params if p not in have]
            if lacking:
                missing.append(f"{hook} without the parameters {lacking}")
    return missing


def engine_version(engine: str) -> str:
    try:
        return importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def hooks_message(engine: str, missing: List[str]) -> str:
    return (f"jakiro_ext's {engine} draft class ({ARCHITECTURE}) does not fit {engine} {engine_version(engine)}: "
            f"{'; '.join(missing)}. Supported: {engine} {', '.join(SUPPORTED[engine])}")


def require(engine: str) -> None:
    """Raise the hooks' message when ``engine`` lacks one (the draft classes' modules call this first)."""
    missing = missing_hooks(engine)
    if missing:
        raise RuntimeError(hooks_message(engine, missing))


def register_vllm() -> None:
    """vLLM's plugin: the serving format's architecture -> :mod:`jakiro_ext.serving.vllm_draft`
    (imported by vLLM only when a head of that architecture is loaded)."""
    missing = missing_hooks("vllm")
    if missing:
        warnings.warn(hooks_message("vllm", missing), RuntimeWarning, stacklevel=2)
    if not any(h.startswith("vllm:ModelRegistry") for h in missing):
        from vllm import ModelRegistry
        ModelRegistry.register_model(ARCHITECTURE, VLLM_CLASS)


def register_sglang() -> None:
    """SGLang's plugin: the classes of :mod:`jakiro_ext.serving.sglang_models` (its ``EntryClass``)."""
    missing = missing_hooks("sglang")
    if missing:
        warnings.warn(hooks_message("sglang", missing), RuntimeWarning, stacklevel=2)
    if not any(h.startswith("sglang.srt.models.registry:ModelRegistry") for h in missing):
        from sglang.srt.models.registry import ModelRegistry
        ModelRegistry.register(SGLANG_PACKAGE, overwrite=True)
