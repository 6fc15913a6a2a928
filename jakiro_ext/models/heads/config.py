"""A draft head's configuration (``DraftConfig``), the files of a saved head and how they are written."""
from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from jakiro_ext.atomic import write_directory
from jakiro_ext.kv_cache import CacheShape
from jakiro_ext.models.llama import LlamaConfig


def target_config(target) -> LlamaConfig:
    """The engine's config of a target given as a ``LlamaConfig``, a ``LlamaModel``, a transformers
    causal LM or a transformers config (of a supported family: :meth:`LlamaConfig.from_hf`)."""
    if isinstance(target, LlamaConfig):
        return target
    config = getattr(target, "config", target)  # a model (ours or transformers') -> its config
    if isinstance(config, LlamaConfig):
        return config
    if hasattr(config, "model_type") and hasattr(config, "hidden_size"):
        return LlamaConfig.from_hf(config)
    raise TypeError(f"target must be a LlamaConfig, a LlamaModel, a transformers model or its config, "
                    f"got {type(target).__name__}")


KINDS = ("eagle2", "jakiro", "gumiho", "jakiro_gumiho")  # jakiro_gumiho: Jakiro's MoE layer, then MLP heads
MOE_KINDS = ("jakiro", "jakiro_gumiho")  # the kinds with Jakiro's MoE layer
MLP_HEAD_KINDS = ("gumiho", "jakiro_gumiho")  # the kinds with Gumiho's parallel MLP heads
CONFIG_FILE = "config.json"


def default_feature_layers(num_layers: int) -> tuple:
    """The target layers whose input an EAGLE-3-style head reads by default: 2, L / 2 and L - 3 (vLLM's)."""
    return 2, num_layers // 2, num_layers - 3


WEIGHTS_FILE = "model.safetensors"
ACCEPTANCE_FILE = "acceptance.json"  # optional: the head's acceptance profile (jakiro_ext.engine.tree_cost)


def read_acceptance(file: Path) -> dict:
    """An acceptance profile; a malformed one is a ValueError naming the file."""
    try:
        raw = json.loads(Path(file).read_text())
        tables = [raw["depth_rank"]] + [raw[k] for k in ("contrastive_depth_rank", "mlp_depth_rank") if k in raw]
        ok = all(isinstance(t, list) and t and all(isinstance(row, list) and row and
                                                   all(isinstance(p, (int, float)) and 0 <= p <= 1 for p in row)
                                                   for row in t) for t in tables)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: not an acceptance profile ({exc})") from None
    if not ok:
        raise ValueError(f"{file}: depth_rank must be a non-empty list of non-empty lists of probabilities in [0, 1]")
    return raw


@dataclass
class DraftConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's width, or each expert's
    num_experts: int = 0  # 0: dense EAGLE-2 head; >= 2: Jakiro MoE head
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    renormalize: bool = False  # top-2 gate scores renormalised to sum to 1 (paper: not)
    draft_vocab_size: int = 0  # 0: draft over the target's whole vocabulary; else over this many of its tokens
    target: str = ""  # the target model it was made for (informational)
    num_layers: int = 1  # serial decoder layers (more than one: dense feed-forward blocks only)
    num_mlp_heads: int = 0  # Gumiho's parallel MLP heads (0: none)
    mlp_blocks: int = 5  # residual blocks of each MLP head
    # Empty: the head reads the target's final hidden state. Three layer ids: at a committed token
    # it reads the streams entering those target layers, fused (``fuse``: 3H -> H, EAGLE-3's fc).
    feature_layers: List[int] = field(default_factory=list)

    def __post_init__(self):
        self.feature_layers = list(self.feature_layers)  # (a tuple given compares unequal to the list read back)
        layers = self.feature_layers
        if layers and (len(layers) != 3 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
                       or self.num_layers > 1 or self.num_mlp_heads):
            raise ValueError(f"feature_layers must be empty or three target layer ids >= 0 of a one-layer head without "
                             f"MLP heads, got {layers} ({self.num_layers} layers, {self.num_mlp_heads} MLP heads)")

    @property
    def kind(self) -> str:
        if self.num_mlp_heads:
            return "jakiro_gumiho" if self.num_experts else "gumiho"
        return "jakiro" if self.num_experts else "eagle2"

    @classmethod
    def for_target(cls, target, kind: str = "jakiro", num_experts: int = 8,
                   intermediate_size: Optional[int] = None, target_name: str = "", num_layers: Optional[int] = None,
                   num_mlp_heads: int = 2, mlp_blocks: int = 5, feature_layers: Sequence[int] = ()) -> "DraftConfig":
        """A head shaped for ``target``: its attention geometry; experts as wide as the hidden
        size (the released Jakiro recipe) or the target's MLP width for the dense head. A
        ``gumiho`` head has ``num_layers`` serial layers (default 2, as released) and
        ``num_mlp_heads`` MLP heads of ``mlp_blocks`` residual blocks; ``jakiro_gumiho`` the
        same MLP heads after one Jakiro MoE layer. ``target``: the engine's ``LlamaConfig`` or
        ``LlamaModel``, a transformers model or its config (``target_name`` then defaults to the
        model's name). ``feature_layers``: the three target layers a fused head reads (EAGLE-3's
        features; a one-layer eagle2 or jakiro head)."""
        target = target_config(target)
        target_name = target_name or target.name
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        moe, gumiho = kind in MOE_KINDS, kind in MLP_HEAD_KINDS
        if moe and num_experts < 2:
            raise ValueError(f"a Jakiro head needs num_experts >= 2 (top-2 routing), got {num_experts}")
        if gumiho and num_mlp_heads < 1:
            raise ValueError(f"a Gumiho head needs num_mlp_heads >= 1, got {num_mlp_heads}")
        width = intermediate_size or (target.hidden_size if moe else target.intermediate_size)
        return cls(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, intermediate_size=width,
                   num_experts=num_experts if moe else 0, rope_theta=target.rope_theta,
                   rms_norm_eps=target.rms_norm_eps, target=target_name,
                   num_layers=num_layers or (2 if kind == "gumiho" else 1), num_mlp_heads=num_mlp_heads if gumiho else 0,
                   mlp_blocks=mlp_blocks, feature_layers=list(feature_layers))

    @classmethod
    def from_json(cls, file: Path) -> "DraftConfig":
        """The config saved in ``file``; anything malformed is a ValueError naming the file."""
        try:
            raw = json.loads(Path(file).read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: not a JSON config ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = set(raw) - set(known)
        if unknown:
            raise ValueError(f"{file}: unknown keys {sorted(unknown)} (expected a subset of {sorted(known)})")
        missing = [name for name, f in known.items()
                   if f.default is MISSING and f.default_factory is MISSING and name not in raw]
        if missing:
            raise ValueError(f"{file}: missing keys {missing}")
        for name, value in raw.items():
            kind = known[name].type  # a string: the module uses postponed annotations
            ok = {"int": isinstance(value, int) and not isinstance(value, bool),
                  "float": isinstance(value, (int, float)) and not isinstance(value, bool),
                  "bool": isinstance(value, bool), "str": isinstance(value, str),
                  "List[int]": isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in value)}[kind]
            if not ok:
                raise ValueError(f"{file}: {name} must be a JSON {'list of ints' if kind == 'List[int]' else kind}, "
                                 f"got {value!r}")
        try:
            config = cls(**raw)
        except ValueError as exc:
            raise ValueError(f"{file}: {exc}") from None
        sizes = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
        problems = [f"{name} must be >= 1, got {getattr(config, name)}" for name in sizes if getattr(config, name) < 1]
        if config.num_experts == 1 or config.num_experts < 0:
            problems.append(f"num_experts must be 0 (dense) or >= 2, got {config.num_experts}")
        if config.num_layers < 1 or (config.num_layers > 1 and config.num_experts):
            problems.append(f"num_layers must be >= 1, and 1 with experts (a MoE head has one layer), got "
                            f"{config.num_layers} with num_experts {config.num_experts}")
        if config.num_mlp_heads < 0 or config.mlp_blocks < 0:
            problems.append(f"num_mlp_heads and mlp_blocks must be >= 0, got {config.num_mlp_heads}, {config.mlp_blocks}")
        if not 0 <= config.draft_vocab_size <= config.vocab_size:
            problems.append(f"draft_vocab_size must be in [0, vocab_size {config.vocab_size}], got {config.draft_vocab_size}")
        if config.num_kv_heads >= 1 and config.num_heads % config.num_kv_heads:
            problems.append(f"num_heads {config.num_heads} must be a multiple of num_kv_heads {config.num_kv_heads}")
        if not (math.isfinite(config.rope_theta) and config.rope_theta > 0 and math.isfinite(config.rms_norm_eps)
                and config.rms_norm_eps > 0):
            problems.append(f"rope_theta and rms_norm_eps must be finite and > 0, got {config.rope_theta}, "
                            f"{config.rms_norm_eps}")
        if problems:
            raise ValueError(f"{file}: " + "; ".join(problems))
        return config

    def cache_shape(self) -> CacheShape:
        """The geometry the draft's KV cache is shaped by: a layer per serial layer (EAGLE-3's
        config, which shares this method, has one)."""
        return CacheShape(getattr(self, "num_layers", 1), self.num_kv_heads, self.head_dim)


TRAINING_FILE = "training.json"  # optional: how the head was trained (the train command's summary)


# The files a head directory is made of: rewriting a head replaces them all, none survives stale.
HEAD_FILES = (CONFIG_FILE, WEIGHTS_FILE, ACCEPTANCE_FILE, TRAINING_FILE, "pytorch_model.bin")


def write_head_files(path, config: dict, state: dict, dtype: Optional[torch.dtype], metadata: dict,
                     extra_files: Optional[dict] = None) -> None:
    """A head directory, replaced atomically (:func:`jakiro_ext.atomic.write_directory`):
    ``config.json``, ``model.safetensors`` (floating tensors in ``dtype`` if given; ``metadata``,
    str -> str, in the file's header) and ``extra_files`` (name -> text). A kill at any moment
    leaves the whole old head or the whole new one; other files of the old directory (a training
    checkpoint) are kept."""
    from safetensors.torch import save_file

    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous()
             for k, v in state.items()}
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:  # (a head that cannot draft is not saved: loading it would refuse it anyway)
        raise ValueError(f"not saving the head to {path}: {', '.join(bad[:3])} "
                         f"{'hold' if len(bad) > 1 else 'holds'} non-finite values"
                         + (f" in {dtype}" if dtype is not None else "") + " (nothing was written)")
    unknown = set(extra_files or {}) - set(HEAD_FILES)
    if unknown:
        raise ValueError(f"a head directory's extra files are among {HEAD_FILES}, got {sorted(unknown)}")

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", **metadata})
        # safetensors creates the file readable by its owner alone; a head is for others to load too
        # (the mode of the config file written beside it: the user's umask).
        os.chmod(tmp / WEIGHTS_FILE, (tmp / CONFIG_FILE).stat().st_mode & 0o777)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    write_directory(path, write, HEAD_FILES)
