"""What the commands share: loading the target and the shipped heads, prompts, the tree options,
threads, and running a method on a prompt."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from jakiro_ext.config import CPU_TREE, GPU_TREE, MAX_BATCH, TreeConfig, check_sampling_options
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.engine.policy import default_tree
from jakiro_ext.engine.sequence import GenerationOutput
from jakiro_ext.methods import METHODS
from jakiro_ext.models import load_default_target
from jakiro_ext.models.default import DEFAULT_MODEL
from jakiro_ext.models.gguf import gguf_tokenizer, load_gguf
from jakiro_ext.models.heads.config import MLP_HEAD_KINDS, MOE_KINDS, DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.formats import a_kind, check_head_directory, read_config
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.paths import packaged_corpus

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"
# The heads a --<kind>-head option takes (a jakiro_gumiho head has both Jakiro's MoE layer and
# Gumiho's MLP heads).
HEADS_FOR = {"eagle2": ("eagle2",), "jakiro": MOE_KINDS, "gumiho": MLP_HEAD_KINDS, "jakiro_gumiho": ("jakiro_gumiho",)}


# ----------------------------------------------------------------------------- set-up
def load_target(dtype_name: str, device: str = "cpu", directory: Optional[str] = None):
    """(the engine's target, its tokenizer, its name): the default model, the transformers model
    in ``directory`` (a local directory: nothing is fetched from a hub) or a GGUF file's model.
    ``dtype_name``: float32, bfloat16, or gguf (a GGUF file's own blocks: the CPU only)."""
    if dtype_name == "gguf" and device != "cpu":
        raise ValueError(f"--dtype gguf runs a GGUF file's blocks on the CPU, not on {device}: use --dtype float32 "
                         "or bfloat16 there")
    if directory is not None and str(directory).endswith(".gguf"):
        if not Path(directory).is_file():
            raise ValueError(f"--target {directory}: no such GGUF file")
        weights = "file" if dtype_name == "gguf" else dtype_name
        target = load_gguf(directory, weights)
        return target.to(device), gguf_tokenizer(directory), target.config.name
    if directory is None:
        target, tokenizer = load_default_target("gguf" if dtype_name == "gguf" else getattr(torch, dtype_name))
        return target.to(device), tokenizer, DEFAULT_MODEL
    if dtype_name == "gguf":
        raise ValueError(f"--dtype gguf reads a GGUF file: --target {directory} is a transformers directory")
    dtype = getattr(torch, dtype_name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(directory, "config.json").is_file():
        raise ValueError(f"--target {directory}: not a transformers model directory (no config.json)")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return LlamaModel.from_hf(hf, dtype).to(device), tokenizer, Path(directory).name


def corpus_option(data: Optional[str]) -> Optional[str]:
    """A ``--data`` value: a path as it is, or where no such path exists, the name of a token
    corpus the package ships (``SmolLM2-135M-Instruct``: the README's line, run from anywhere)."""
    packaged = packaged_corpus(data) if data and not Path(data).exists() else None
    if packaged is None:
        return data
    print(f"--data {data}: the packaged token corpus {packaged}", file=sys.stderr)
    return str(packaged)


def check_head_option(path: Optional[str]) -> None:
    """A head directory given by an option exists and holds a readable config.json (checked again,
    with its weights, when the head loads)."""
    if path is not None:
        check_head_directory(Path(path))
        read_config(Path(path))


def load_head(kind: str, path: Optional[str], target, model_name: str):
    """The head at ``path``, else the one shipped for the default model, else (said loudly on
    stderr) a randomly initialised head: lossless all the same, but it accepts almost nothing."""
    shipped = HEADS_DIR / f"{model_name}-{kind}"
    if path is None and shipped.exists():
        path = str(shipped)
    if path is not None:
        head = DraftHead.load(path, target)
        if head.config.kind not in HEADS_FOR[kind]:
            raise ValueError(f"{path} holds {a_kind(head.config.kind)} head, but {a_kind(kind)} head is needed")
        return head
    print(f"warning: no trained {kind} head for {model_name} (looked in {shipped}); using a RANDOMLY initialised "
          f"head: the output is still exact, but almost no draft token will be accepted. Pass --{kind.replace('_', '-')}-head.",
          file=sys.stderr)
    config = DraftConfig.for_target(target.config, kind, target_name=model_name)
    return DraftHead(config).init_weights(seed=0).bind(target)


def chat_ids(tokenizer, prompt: str, chat_template: bool = True) -> torch.Tensor:
    if not chat_template:
        return torch.tensor(tokenizer.encode(prompt), dtype=torch.int64)
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt")
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return ids[0].to(torch.int64)


def tree_from_args(args) -> Optional[TreeConfig]:
    """The tree the options ask for; None for ``--tree auto`` or ``cost`` without explicit settings
    (each method's tree is then the engine's choice, or the one its measured costs rank best:
    ``Runner.tree_for``)."""
    if args.static_tree:
        if any(x is not None for x in (args.total_tokens, args.depth, args.top_k_draft)):
            raise ValueError("--static-tree fixes the whole tree: drop --total-tokens, --depth and --top-k-draft")
        try:
            return TreeConfig(choices=json.loads(args.static_tree))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--static-tree must be JSON like [[0], [1], [0, 0]], got {args.static_tree!r}: {exc}") from None
    explicit = [x for x in (args.total_tokens, args.depth, args.top_k_draft) if x is not None]
    if args.tree in ("auto", "cost") and not explicit:
        return None
    base = GPU_TREE if args.tree == "gpu" else CPU_TREE  # auto with explicit settings: they override the cpu preset
    pick = lambda given, default: default if given is None else given  # noqa: E731  (0 is an error, not a default)
    return TreeConfig(pick(args.total_tokens, base.total_tokens), pick(args.depth, base.depth),
                      pick(args.top_k_draft, base.top_k))


def tree_dict(tree: TreeConfig) -> dict:
    if tree.choices is not None:
        return dict(choices=tree.choices)
    return dict(total_tokens=tree.total_tokens, depth=tree.depth, top_k=tree.top_k)


def set_threads(threads: int) -> None:
    """--threads: 0 keeps torch's default; more than 4 per core only slows down (and far more crashes torch)."""
    most = 4 * (os.cpu_count() or 1)
    if not 0 <= threads <= most:
        raise ValueError(f"--threads must be in [0, {most}] (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)


def check_generation_args(args) -> Optional[TreeConfig]:
    """Every generation option, checked before a model is loaded (the same checks as the API's);
    returns the draft tree."""
    check_sampling_options(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    prompt = getattr(args, "prompt", None)
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 reach argv as surrogate escapes
            raise ValueError("the prompt is not valid UTF-8 text") from None
    limit = getattr(args, "limit", None)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    batch_size = getattr(args, "batch_size", 1)
    if not 1 <= batch_size <= MAX_BATCH:
        raise ValueError(f"--batch-size must be in [1, {MAX_BATCH}], got {batch_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if args.graphs == "cuda" and args.device != "cuda":
        raise ValueError(f"--graphs cuda needs --device cuda, got --device {args.device}")
    return tree_from_args(args)


class Runner:
    """The target, its tokenizer and the heads the requested methods need, loaded once."""

    def __init__(self, args, methods: List[str], tree: Optional[TreeConfig]):
        set_threads(args.threads)
        self.args = args
        self.tree = tree
        self.trees: Dict[str, TreeConfig] = {}
        kinds = sorted({METHODS[m].shipped_head for m in methods if METHODS[m].drafts})
        for kind in kinds:  # what can be checked of the heads' directories before the model loads
            check_head_option(getattr(args, f"{kind}_head"))
        activity.now = "loading the target model"
        self.target, self.tokenizer, self.name = load_target(args.dtype, args.device, args.target)
        self.heads: Dict[str, object] = {}
        for kind in kinds:
            activity.now = f"loading the {kind} draft head"
            self.heads[kind] = load_head(kind, getattr(args, f"{kind}_head"), self.target, self.name)
        activity.now = "generating"

    def tree_for(self, method: str) -> Optional[TreeConfig]:
        """The asked tree; with ``--tree cost`` the one the measured costs rank best for the
        method's head (when it has an acceptance profile, else the device's preset), fixed for
        the run; else None: the engine's choice (live for a head with an acceptance profile)."""
        if self.tree is not None or self.args.tree != "cost":
            return self.tree
        if method not in self.trees:
            self.trees[method] = self.default_tree(method)
        return self.trees[method]

    def default_tree(self, method: str) -> TreeConfig:
        """The tree the measured costs rank best for the method's head (else the device's preset)."""
        return default_tree(self.target, self.head_for(method), method, None, getattr(self.args, "batch_size", 1))

    def head_for(self, method: str):
        """The head the method drafts with (None for ``ar``)."""
        return self.heads.get(METHODS[method].shipped_head)

    def tree_said(self, method: str):
        """The method's tree as reports give it: its settings, or "live" (chosen round by round)."""
        tree = self.tree_for(method)
        if tree is None and getattr(self.head_for(method), "acceptance", None):
            return "live"
        # (the engine's choice without a profile: the preset, as the engine's FixedTree takes it)
        return tree_dict(tree if tree is not None else self.default_tree(method))

    def run(self, method: str, prompt_ids, on_tokens=None, max_new_tokens: Optional[int] = None):
        """``speculative_generate`` with the command's options: one prompt (a GenerationOutput)
        or a list of prompts decoded as one batch (a list of them)."""
        a = self.args
        return speculative_generate(self.target, self.head_for(method), prompt_ids, max_new_tokens or a.max_new_tokens, method=method,
                                    tree=self.tree_for(method),
                                    temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                    eos_token_id=self.tokenizer.eos_token_id, seed=a.seed, on_tokens=on_tokens,
                                    graphs=a.graphs)


def print_stats(method: str, out: GenerationOutput) -> None:
    s = out.stats
    print(f"[{method}] {s.new_tokens} tokens in {s.wall_time_s:.2f} s ({s.tokens_per_s:.1f} tokens/s, prefill "
          f"{s.prefill_s * 1e3:.0f} ms); {s.target_forwards} target forwards, tau {s.tau:.2f}; "
          f"{s.draft_forwards} draft forwards; accepted-length histogram {s.accept_histogram}; stop: {s.stop_reason}")
    rounds = len(s.accept_lengths)
    if METHODS[method].drafts and s.plain_rounds:
        print(f"[{method}] {s.plain_rounds} of {rounds} rounds were plain decoding: the tree chosen live found no "
              f"draft tree that paid on this machine then (a busy machine, or a head that is rarely right)")


@dataclass
class Activity:
    """What the command is doing (for the line an interrupt or a failed allocation prints), and
    what it has saved."""
    now: str = "starting"
    saved: str = ""


activity = Activity()
