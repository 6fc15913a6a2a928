"""Draft heads in the formats their authors publish: read into this package's
:class:`~jakiro_ext.models.heads.draft_head.DraftHead`, and written for the serving engines.

A directory holds ``config.json`` (a transformers-style Llama config) and the weights
(``model.safetensors`` or ``pytorch_model.bin``):

- ``eagle`` (EAGLE-1 / EAGLE-2, as vLLM and SGLang load them for their ``eagle`` method): ``fc``
  [H, 2H] with bias over ``cat(embedding, feature)``, one decoder layer ``layers.0.*`` with no norm
  before its attention (``layers.0.input_layernorm.weight``, when present, is unused), a dense
  SwiGLU ``layers.0.mlp``; optionally ``embed_tokens.weight`` (the target's, shared here);
- ``jakiro`` (the released Jakiro heads): the same, with the MoE ``layers.0.mlp_moe``: router
  ``gate.weight`` [N + 2, H] and SwiGLU ``experts.{i}``; config keys ``num_local_experts`` and
  ``num_experts_per_tok`` (2).

- ``gumiho`` (the released Gumiho heads, AMD-AIG-AIMA/Gumiho ``cnets.py``): the ``eagle`` layout
  with L serial layers ``layers.{i}`` (every layer but the first normed before its attention,
  ``input_layernorm``) and the parallel MLP heads ``mlp.mlp.{j}``: ``0.linear`` [H, 2H] then
  residual blocks ``{b}.linear`` [H, H], all with biases; J and the blocks are read from the keys
  (the released config does not say them).

- ``eagle3`` (EAGLE-3): ``midlayer.*``, ``fc`` over three target layers, its own LM head and
  ``d2t``: :mod:`jakiro_ext.models.heads.eagle3`.

Each format is a :class:`HeadFormat` of :data:`HEAD_FORMATS`, its reader and its writer (this
package's own format ``jakiro_ext`` and the serving plugins' ``serving`` among them); a directory's
format is recognised from its config, else from its weights' names (:func:`recognise`).
"""
from __future__ import annotations

import json
from pathlib import Path
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, Optional, Tuple

import torch

from jakiro_ext.models.heads.config import CONFIG_FILE, WEIGHTS_FILE, DraftConfig
from jakiro_ext.serving import format as serving_format

SAFETENSORS, TORCH_BIN = "model.safetensors", "pytorch_model.bin"
FORMATS = ("jakiro_ext", "eagle", "jakiro", "gumiho", "eagle3", "serving")  # jakiro_ext: this package's own
# (draft_head.py); serving: what this package's engine plugins load (jakiro_ext.serving.format)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # a decoder layer's projections, by their checkpoint names
MLP = ("gate_proj", "up_proj", "down_proj")


def a_kind(kind: str) -> str:
    """'a jakiro', 'an eagle2': a kind of head (or format) with its article."""
    return ("an " if kind[:1] in ("a", "e", "i", "o", "u") else "a ") + kind


def check_head_directory(path: Path) -> None:
    """A FileNotFoundError, saying what a head directory holds, when ``path`` is none."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"draft head directory {path} not found: a draft head directory holds {CONFIG_FILE} "
                                f"and {WEIGHTS_FILE}")


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a draft head directory holds config.json and its weights "
                                f"({SAFETENSORS} or {TORCH_BIN})")
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not a JSON config ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_weights(path: Path) -> Tuple[Dict[str, torch.Tensor], Path]:
    """The tensors of ``model.safetensors``, else of ``pytorch_model.bin`` (loaded with
    ``weights_only``: no code runs), and the file they came from."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (path / SAFETENSORS).is_file():
        file = path / SAFETENSORS
        try:
            return load_file(str(file)), file
        except SafetensorError as exc:
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
    if (path / TORCH_BIN).is_file():
        file = path / TORCH_BIN
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
            raise ValueError(f"{file}: not a readable PyTorch weights file ({exc})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{file}: expected a dict of tensors (a state dict)")
        return state, file
    raise FileNotFoundError(f"no weights in {path}: expected {SAFETENSORS} or {TORCH_BIN}")


def tensor_getter(state: Dict[str, torch.Tensor], head: str, where: str):
    """``need(key)``: the tensor ``key`` of ``state``; a missing one is a ValueError naming it
    (and ``head``, e.g. "an eagle3 head")."""
    def need(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"{where}: {head} needs the tensor {key!r}, which is missing")
        return state[key]
    return need


def check_layer_config(config: dict, where: str) -> None:
    """What a released head's config may ask that the draft layers do not implement."""
    if config.get("rope_scaling") is not None:
        raise ValueError(f"{where}: rope_scaling {config['rope_scaling']} is not supported for draft heads")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act must be 'silu' (SwiGLU), got {config['hidden_act']!r}")


def is_own(config: dict) -> bool:
    """Whether config.json is this package's own (DraftConfig's keys, no transformers architecture)."""
    return "architectures" not in config and "num_experts" in config


def detect(config: dict, keys) -> str:
    """The format of a head from its config and weight names."""
    keys = set(keys)
    if is_own(config):
        return "jakiro_ext"
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "layers.0.mlp_moe.gate.weight" in keys:
        return "jakiro"
    if any(k.startswith("mlp.mlp.") for k in keys):
        return "gumiho"
    if "fc.weight" in keys and "layers.0.mlp.gate_proj.weight" in keys:
        return "eagle"
    raise ValueError("not a draft head format this package reads: expected this package's config, EAGLE-1/2 keys "
                     "(fc.weight, layers.0.mlp.gate_proj.weight), Jakiro keys (layers.0.mlp_moe.gate.weight) or "
                     "Gumiho keys (mlp.mlp.0.0.linear.weight); "
                     f"found keys {sorted(keys)[:6]}")


def to_draft_head(config: dict, state: Dict[str, torch.Tensor], fmt: str, where: str):
    """(DraftConfig, this package's state dict) of an ``eagle``, ``jakiro`` or ``gumiho`` head;
    anything that does not match the format is a ValueError naming ``where`` and the key or shape."""
    if fmt not in ("eagle", "jakiro", "gumiho"):
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    need = tensor_getter(state, f"{a_kind(fmt)} head", where)

    def setting(name: str, default=None):
        value = config.get(name, default)
        if value is None:
            raise ValueError(f"{where}: config.json needs {name!r}")
        return value

    check_layer_config(config, where)
    fc = need("fc.weight")
    H = setting("hidden_size", fc.shape[0])
    heads = setting("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or H // heads
    ours = {"fc.weight": fc, "fc.bias": need("fc.bias"),
            "post_attention_layernorm.weight": need("layers.0.post_attention_layernorm.weight")}
    for name in ATTENTION:
        ours[f"{name}.weight"] = need(f"layers.0.self_attn.{name}.weight")
        if f"layers.0.self_attn.{name}.bias" in state:
            raise ValueError(f"{where}: layers.0.self_attn.{name}.bias: attention biases are not supported in draft heads")
    used = {f"layers.0.self_attn.{n}.weight" for n in ATTENTION} | {
        "fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight"}
    ignored = {"embed_tokens.weight", "layers.0.input_layernorm.weight"}  # shared with the target / unused by layer 0
    layers = mlp_heads = blocks = 0
    if fmt == "gumiho":  # layers 1.. and the MLP heads; layer 0 as in the eagle format
        layers = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()),
                         default=0)
        for i in range(1, layers):
            for mine, theirs in [(f"{n}.weight", f"self_attn.{n}.weight") for n in ATTENTION] + [
                    (f"{n}.weight", f"mlp.{n}.weight") for n in MLP] + [
                    (f"{n}.weight", f"{n}.weight") for n in ("input_layernorm", "post_attention_layernorm")]:
                ours[f"layers.{i - 1}.{mine}"] = need(f"layers.{i}.{theirs}")
                used.add(f"layers.{i}.{theirs}")
        mlp_heads = len({k.split(".")[2] for k in state if k.startswith("mlp.mlp.")})
        blocks = len({k.split(".")[3] for k in state if k.startswith("mlp.mlp.0.")}) - 1
        parts = {(j, b, p): need(f"mlp.mlp.{j}.{b}.linear.{p}") for j in range(mlp_heads) for b in range(blocks + 1)
                 for p in ("weight", "bias")}
        used |= {f"mlp.mlp.{j}.{b}.linear.{p}" for j, b, p in parts}
        stack = lambda b, p: torch.stack([parts[j, b, p] for j in range(mlp_heads)])  # noqa: E731
        ours.update({"mlp_in_weight": stack(0, "weight"), "mlp_in_bias": stack(0, "bias")})
        ours.update({"mlp_block_weight": torch.stack([stack(b, "weight") for b in range(1, blocks + 1)], 1) if blocks
                     else fc.new_zeros(mlp_heads, 0, H, H),
                     "mlp_block_bias": torch.stack([stack(b, "bias") for b in range(1, blocks + 1)], 1) if blocks
                     else fc.new_zeros(mlp_heads, 0, H)})
    if fmt in ("eagle", "gumiho"):
        for name in MLP:
            ours[f"{name}.weight"] = need(f"layers.0.mlp.{name}.weight")
            used.add(f"layers.0.mlp.{name}.weight")
        experts, width = 0, ours["gate_proj.weight"].shape[0]
    else:
        router = need("layers.0.mlp_moe.gate.weight")
        experts = router.shape[0] - 2
        declared = config.get("num_local_experts", experts)
        if declared != experts or experts < 2:
            raise ValueError(f"{where}: layers.0.mlp_moe.gate.weight has {router.shape[0]} rows: N + 2 for N = "
                             f"{experts} experts, but config.json says num_local_experts {declared} (N >= 2)")
        if config.get("num_experts_per_tok", 2) != 2:
            raise ValueError(f"{where}: num_experts_per_tok must be 2 (top-2 routing), got {config['num_experts_per_tok']}")
        stacked = {n: [need(f"layers.0.mlp_moe.experts.{i}.{n}.weight") for i in range(experts)] for n in MLP}
        for n, tensors in stacked.items():
            if len({tuple(t.shape) for t in tensors}) != 1:
                raise ValueError(f"{where}: the experts' {n}.weight differ in shape: {[list(t.shape) for t in tensors]}")
        ours.update({"router": router, "w_gate": torch.stack(stacked["gate_proj"]),
                     "w_up": torch.stack(stacked["up_proj"]), "w_down": torch.stack(stacked["down_proj"])})
        used |= {"layers.0.mlp_moe.gate.weight"} | {f"layers.0.mlp_moe.experts.{i}.{n}.weight"
                                                   for i in range(experts) for n in MLP}
        width = ours["w_gate"].shape[1]
    unknown = sorted(set(state) - used - ignored)
    if unknown:
        raise ValueError(f"{where}: tensors {a_kind(fmt)} head does not have: {unknown[:4]}")
    draft = DraftConfig(hidden_size=H, vocab_size=setting("vocab_size"), num_heads=heads, num_kv_heads=kv_heads,
                        head_dim=head_dim, intermediate_size=width, num_experts=experts,
                        rope_theta=float(config.get("rope_theta", 10000.0)), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                        renormalize=bool(config.get("norm_topk_prob", False)), num_layers=max(layers, 1),
                        num_mlp_heads=mlp_heads, mlp_blocks=blocks if mlp_heads else DraftConfig.mlp_blocks)
    return draft, ours


def eagle_files(head) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """config.json and the tensors of a dense head in the ``eagle`` format (what vLLM's and
    SGLang's ``eagle`` methods load with their own EAGLE draft classes: each engine takes the first
    architecture it knows, ``EagleLlamaForCausalLM`` vLLM, ``LlamaForCausalLMEagle`` SGLang). No
    ``bias`` key: vLLM would build attention biases that nothing loads."""
    c = head.config
    if c.feature_layers:
        raise ValueError(f"this head reads target layers {c.feature_layers} fused, which the eagle format cannot say: "
                         "it is saved in this package's format (format='jakiro_ext')")
    if c.num_experts:
        raise ValueError("the eagle format holds dense heads: save a Jakiro (MoE) head with format='serving', which "
                         "this package's vLLM and SGLang plugins load (jakiro_ext.serving)")
    if c.num_mlp_heads or c.num_layers > 1:
        raise ValueError(f"the eagle format holds one-layer dense heads: this {c.kind} head has {c.num_layers} layers and "
                         f"{c.num_mlp_heads} MLP heads, which no serving engine runs")
    if c.draft_vocab_size:
        raise ValueError(f"this head drafts over {c.draft_vocab_size} of the target's tokens, which the eagle format "
                         "cannot say (its drafts would range over the whole vocabulary): save it with "
                         "full_vocabulary=True to accept that")
    config = {"architectures": ["EagleLlamaForCausalLM", "LlamaForCausalLMEagle"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "rope_scaling": None, "vocab_size": c.vocab_size, "attention_bias": False, "tie_word_embeddings": False}
    mine = head.state_dict()
    state = {"fc.weight": mine["fc.weight"], "fc.bias": mine["fc.bias"],
             "layers.0.post_attention_layernorm.weight": mine["post_attention_layernorm.weight"]}
    state.update({f"layers.0.self_attn.{n}.weight": mine[f"{n}.weight"] for n in ATTENTION})
    state.update({f"layers.0.mlp.{n}.weight": mine[f"{n}.weight"] for n in MLP})
    return config, state


# ----------------------------------------------------------------------------- the registry
Weights = Tuple[Dict[str, torch.Tensor], Path]  # (tensors, the file they came from)


@dataclass(frozen=True)
class HeadFormat:
    """One format of a draft head's directory. ``read(head_class, path, config, fits, weights)``:
    the head of ``path`` whose config.json is ``config``, its weights loaded and checked
    (``weights``: already read, else None; ``fits(head)``: its check against the target, called
    before the weights are read where the config alone says the shapes). ``write(head,
    full_vocabulary)``: (config.json, tensors) of ``head`` in the format; None: read only."""
    name: str
    read: Callable
    write: Optional[Callable] = None


HEAD_FORMATS: Dict[str, HeadFormat] = {}


def register(fmt: HeadFormat) -> None:
    HEAD_FORMATS[fmt.name] = fmt


def recognise(path: Path, config: dict) -> Tuple[str, Optional[Weights]]:
    """The format of the head at ``path`` (config.json ``config``): the serving plugins' and this
    package's own by their configs, a released one by its weights' names (then read: returned)."""
    if serving_format.is_serving(config):
        return "serving", None
    if is_own(config):
        return "jakiro_ext", None
    weights = read_weights(path)
    return detect(config, weights[0]), weights


def _read_own(cls, path: Path, config: dict, fits: Callable, weights: Optional[Weights] = None):
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{path / WEIGHTS_FILE} not found: a draft head directory holds {CONFIG_FILE} "
                                f"and {WEIGHTS_FILE}")
    return _filled(cls, DraftConfig.from_json(path / CONFIG_FILE), fits, lambda: weights or read_weights(path))


def _read_serving(cls, path: Path, config: dict, fits: Callable, weights: Optional[Weights] = None):
    state, file = weights or read_weights(path)
    fields, state = serving_format.from_serving(config, state, str(file))
    return _filled(cls, DraftConfig(**fields), fits, lambda: (state, file))


def _released_reader(fmt: str) -> Callable:
    def read(cls, path: Path, config: dict, fits: Callable, weights: Optional[Weights] = None):
        state, file = weights or read_weights(path)
        draft_config, state = to_draft_head(config, state, fmt, str(file))
        return _filled(cls, draft_config, fits, lambda: (state, file))
    return read


def _filled(cls, config: DraftConfig, fits: Callable, weights: Callable[[], Weights]):
    """A head of ``config`` checked by ``fits`` (against its target) before ``weights()`` are read,
    then given every one of its tensors from them (no initialisation: a missing tensor is an error)."""
    head = cls(config, init=False)
    fits(head)
    head.load_checked_state(*weights())
    return head


def _write_eagle(head, full_vocabulary: bool):
    if full_vocabulary and head.config.draft_vocab_size:  # the full vocabulary's LM head rows: no d2t
        whole = type(head)(replace(head.config, draft_vocab_size=0), init=False)
        whole.load_state_dict({k: v for k, v in head.state_dict().items() if k != "draft_to_target"})
        head = whole
    return eagle_files(head)


def _write_own(head, full_vocabulary: bool):
    config = asdict(head.config)
    if not config["feature_layers"]:  # (a head reading the final hidden state: its config as before fused heads)
        del config["feature_layers"]
    return config, head.state_dict()


register(HeadFormat("jakiro_ext", _read_own, _write_own))
register(HeadFormat("eagle", _released_reader("eagle"), _write_eagle))
register(HeadFormat("jakiro", _released_reader("jakiro")))
register(HeadFormat("gumiho", _released_reader("gumiho")))
register(HeadFormat("serving", _read_serving, lambda head, full_vocabulary: serving_format.serving_files(head)))

