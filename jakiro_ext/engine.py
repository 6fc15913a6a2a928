"""The draft-verify loop: ``speculative_generate`` and ``generate_many``.

Each round the draft head proposes a tree per sequence, rooted at its last emitted token (not yet
in the target's cache); the target runs every tree of the batch in one forward
(``jakiro::tree_attention`` with each tree's ancestor mask), ``jakiro::verify_tree`` accepts each
sequence's longest valid path plus a bonus token (greedy, or lossless recursive rejection
sampling), the KV cache keeps the accepted paths (``jakiro::compact_kv``), and the draft catches
up on the accepted tokens with the target's fresh hidden states. Plain decoding (``ar``) is the
same loop with one-node trees.

A batch decodes its sequences together; a finished one leaves and, with more requests waiting
(``generate_many``), the next takes its place (continuous batching). Every sequence gets exactly
the tokens it gets alone: its prompt is prefilled alone, and on the CPU the target computes each
sequence's rows the same way whatever else shares its forward (linear layers in row-exact chunks
of 64, attention split at fixed key offsets), as long as its tree has the batch's node count
(dynamic and static trees always do, but for repeated candidates of ``jakiro_star``; a padded tree
changes the attention's row count).

Bad arguments are a TypeError (wrong type) or ValueError (wrong value) naming the argument,
raised before anything is allocated or run. The KV caches start small and grow on demand, up to
what the generation can use: the prompt, the tokens the context limit and ``max_new_tokens``
leave room for, and the largest tree the method can draft.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from jakiro_ext import ops
from jakiro_ext.drafting import METHODS as METHOD_SPECS
from jakiro_ext.drafting import DRAFT_ERRORS, Drafter, Method
from jakiro_ext.graphs import MODES, Replay
from jakiro_ext.models.draft_head import DraftHead, DraftStep
from jakiro_ext.models.llama import LlamaModel, as_target

METHODS = tuple(METHOD_SPECS)  # ("ar", "eagle2", "jakiro", "jakiro_star", "gumiho")
INITIAL_ROOM = 256  # new tokens the KV caches hold before their first growth
MAX_BATCH = 1024  # sequences decoded together (each holds its own KV cache rows)
GRAPH_MODES = ("eager", *MODES)  # how a round's device work is launched (speculative_generate's graphs)
# Bounds of a draft tree (TreeConfig): far beyond every published tree (60 nodes, depth 5-8,
# top-k 10), and small enough that one round can neither hang nor allocate without bound.
MAX_TREE_NODES, MAX_TREE_DEPTH, MAX_TREE_TOP_K = 1024, 64, 128


# ----------------------------------------------------------------------------- argument checks
def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_for_the_batch(name: str, value, kind: str) -> None:
    """A list or tensor given for a scalar setting: the per-sequence values a batch does not take."""
    if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() > 0):
        raise TypeError(f"{name} must be {kind}, one value for every sequence of a batch (per-sequence values "
                        f"are not supported), got {type(value).__name__} {_brief(value)}")


def _int_arg(name: str, value, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``value`` as an int (any integral number but a bool) within [low, high], else a
    TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _one_for_the_batch(name, value, "an int")
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {_brief(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def _real_arg(name: str, value) -> float:
    """``value`` as a finite float (any real number but a bool), else a TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _one_for_the_batch(name, value, "a real number")
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {_brief(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_sampling_options(max_new_tokens, temperature, top_p, top_k, seed):
    """The generation options shared by the API and the CLI (which checks them before loading a
    model): (max_new_tokens, temperature, top_p, top_k, seed) as ints and floats, or a TypeError
    / ValueError naming the argument."""
    max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 1)
    temperature = _real_arg("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    top_p = _real_arg("top_p", top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    top_k = _int_arg("top_k", top_k, 0)
    seed = _int_arg("seed", seed, 0, 2**63 - 1)
    return max_new_tokens, temperature, top_p, top_k, seed


def _prompt_ids(input_ids, vocab: int, name: str = "input_ids") -> torch.Tensor:
    """One prompt as an int64 [n] tensor: from a list of ints or a 1-D integer tensor, non-empty,
    every id in the target's vocabulary."""
    if isinstance(input_ids, (list, tuple)):
        bad = [x for x in input_ids if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
        if bad:
            raise TypeError(f"{name} must be ints (token ids), got {type(bad[0]).__name__} {_brief(bad[0])}")
        ints = [int(x) for x in input_ids]
        low, high = (min(ints), max(ints)) if ints else (0, 0)  # on Python ints: ids beyond int64 too
        values = None
    elif isinstance(input_ids, torch.Tensor):
        if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 1:
            expected = "[n] (a prompt) or [B, n] (a batch of prompts)" if name == "input_ids" else "[n]"
            raise ValueError(f"{name} must be {expected}, got shape {tuple(input_ids.shape)}")
        values = input_ids.to(torch.int64)
        low, high = (int(values.min()), int(values.max())) if values.numel() else (0, 0)
    else:
        raise TypeError(f"{name} must be a list of ints or an integer tensor, got {type(input_ids).__name__}")
    if (len(ints) if values is None else values.numel()) == 0:
        raise ValueError(f"{name} must not be empty")
    if low < 0 or high >= vocab:
        raise ValueError(f"{name} must be token ids in [0, {vocab}) (the target's vocabulary), "
                         f"got values in [{low}, {high}]")
    return torch.tensor(ints, dtype=torch.int64) if values is None else values.cpu()


def _prompts(input_ids, lengths, vocab: int):
    """(the prompts as int64 [n] tensors, whether to answer with a list). One prompt: a list of
    ints or an integer tensor [n]. A batch: a list of such prompts, or an integer tensor [B, n]
    (with ``lengths`` [B]: row b's prompt is its first lengths[b] ids, the rest padding). A batch
    of one without ``lengths`` (``[[...]]``, a [1, n] tensor as tokenizers return it) is one prompt."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        B, n = input_ids.shape
        if not 1 <= B <= MAX_BATCH:
            raise ValueError(f"input_ids must hold 1 to {MAX_BATCH} prompts (MAX_BATCH), got {B}")
        listed = B > 1 or lengths is not None
        if lengths is None:
            lengths = [n] * B
        elif isinstance(lengths, torch.Tensor) and not (lengths.dtype == torch.bool or lengths.is_floating_point()):
            lengths = lengths.tolist()
        if not isinstance(lengths, (list, tuple)) or len(lengths) != B:
            raise ValueError(f"lengths must give one length per row of input_ids ({B}), got {_brief(lengths)}")
        lengths = [_int_arg(f"lengths[{b}]", x, 1, n) for b, x in enumerate(lengths)]
        return [_prompt_ids(input_ids[b, :lengths[b]], vocab, f"input_ids[{b}]") for b in range(B)], listed
    if lengths is not None:
        raise ValueError("lengths is given only with a padded [B, n] tensor of prompts")
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, torch.Tensor)):
        if len(input_ids) > MAX_BATCH:
            raise ValueError(f"input_ids must hold 1 to {MAX_BATCH} prompts (MAX_BATCH), got {len(input_ids)}")
        return [_prompt_ids(p, vocab, f"input_ids[{b}]") for b, p in enumerate(input_ids)], len(input_ids) > 1
    return [_prompt_ids(input_ids, vocab)], False


def _eos_ids(eos_token_id) -> set:
    """The token ids that end a generation: None, an int or a list / tuple of ints."""
    values = [] if eos_token_id is None else eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in values):
        raise TypeError(f"eos_token_id must be None, an int or a list of ints, got {type(eos_token_id).__name__} "
                        f"{_brief(eos_token_id)}")
    return {int(x) for x in values}


@dataclass
class TreeConfig:
    """Shape of the draft tree.

    Dynamic (EAGLE-2): every expansion keeps the ``top_k`` best nodes of a layer (by cumulative
    draft log-probability) as the next frontier and takes ``top_k`` children of each; after
    ``depth`` expansions (EAGLE-2's convention: a path holds up to depth + 1 drafted tokens)
    the ``total_tokens - 1`` best drafted nodes, with the root, are verified.
    Static (EAGLE-1 / Medusa): ``choices`` lists every node as its path of child ranks from the
    root, e.g. ``[[0], [1], [0, 0]]``: child rank r of a node is its draft's r-th best token.

    Bounded so that a round's work is (MAX_TREE_NODES: verification computes [nodes, vocab]
    logits; a dynamic round drafts up to depth x top_k**2 candidates): at most MAX_TREE_NODES
    nodes, depth <= MAX_TREE_DEPTH, top_k (and static child ranks) < MAX_TREE_TOP_K + 1.
    """
    total_tokens: int = 60
    depth: int = 5
    top_k: int = 10
    choices: Optional[Sequence[Sequence[int]]] = None

    def __post_init__(self):
        for name in ("total_tokens", "depth", "top_k"):
            _int_arg(f"tree {name}", getattr(self, name))
        if self.choices is not None:
            def is_path(p):
                return isinstance(p, (list, tuple)) and all(isinstance(r, numbers.Integral) and not isinstance(r, bool)
                                                            for r in p)
            if not isinstance(self.choices, (list, tuple)) or not all(is_path(p) for p in self.choices):
                raise ValueError(f"static tree choices must be a list of lists of child ranks, got {_brief(self.choices)}")
            paths = {tuple(int(r) for r in p) for p in self.choices}
            if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
                raise ValueError(f"static tree choices must be non-empty paths of ranks >= 0, got {self.choices!r}")
            missing = [p for p in paths if len(p) > 1 and p[:-1] not in paths]
            if missing:
                raise ValueError(f"static tree choices must contain every node's parent; missing parents of {missing[:3]}")
            if (len(paths) + 1 > MAX_TREE_NODES or max(map(len, paths)) > MAX_TREE_DEPTH
                    or max(max(p) for p in paths) >= MAX_TREE_TOP_K):
                raise ValueError(f"a static tree holds at most {MAX_TREE_NODES} nodes (root included), paths of at most "
                                 f"{MAX_TREE_DEPTH} ranks and ranks below {MAX_TREE_TOP_K}; got {len(paths) + 1} nodes, "
                                 f"depth {max(map(len, paths))}, largest rank {max(max(p) for p in paths)}")
        elif not (2 <= self.total_tokens <= MAX_TREE_NODES and 1 <= self.depth <= MAX_TREE_DEPTH
                  and 1 <= self.top_k <= MAX_TREE_TOP_K):
            raise ValueError(f"a dynamic tree needs total_tokens in [2, {MAX_TREE_NODES}], depth in [1, {MAX_TREE_DEPTH}] "
                             f"and top_k in [1, {MAX_TREE_TOP_K}], got {self.total_tokens}/{self.depth}/{self.top_k} "
                             "(total_tokens/depth/top_k)")

    def max_nodes_for(self, method) -> int:
        """The most nodes one round of ``method`` can verify, the root included (what the KV caches
        are sized by). A static tree has its nodes. A dynamic tree keeps at most ``total_tokens``,
        and can't draft more than c children of the root plus, per expansion, c children of each
        of its ``top_k`` frontier nodes, with c = ``top_k`` (``jakiro_star``: 2 ``top_k``, both
        experts' proposals). ``jakiro`` runs depth - 1 expansions, the last one also attaching
        ``top_k`` contrastive candidates per frontier node: the same count."""
        method = METHOD_SPECS[method] if isinstance(method, str) else method
        if method.head is None:
            return 1
        if self.choices is not None:
            return len({tuple(p) for p in self.choices}) + 1
        c = method.children(self.top_k)
        return min(self.total_tokens, 1 + c + self.depth * self.top_k * c)


# The published comparisons' tree, and the CPU default chosen by measurement (README, "Tree size").
GPU_TREE = TreeConfig(60, 5, 10)
CPU_TREE = TreeConfig(6, 2, 2)


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # every target forward, the prompt's included
    draft_forwards: int = 0
    accept_lengths: List[int] = field(default_factory=list)  # drafted tokens accepted, per round
    prefill_s: float = 0.0
    wall_time_s: float = 0.0
    # "eos", "max_new_tokens", "context_limit" (the target's max_position_embeddings came before
    # max_new_tokens) or "cache_full" (a user-given max_cache_len ran out)
    stop_reason: str = ""

    @property
    def tau(self) -> float:
        """Tokens per target forward, counting every forward."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def accept_histogram(self) -> List[int]:
        """Rounds that accepted 0, 1, 2, ... drafted tokens."""
        hist = [0] * (max(self.accept_lengths, default=0) + 1)
        for n in self.accept_lengths:
            hist[n] += 1
        return hist

    def as_dict(self) -> dict:
        return dict(new_tokens=self.new_tokens, target_forwards=self.target_forwards,
                    draft_forwards=self.draft_forwards, tau=self.tau, tokens_per_s=self.tokens_per_s,
                    wall_time_s=self.wall_time_s, prefill_s=self.prefill_s,
                    accept_histogram=self.accept_histogram, stop_reason=self.stop_reason)


@dataclass
class GenerationOutput:
    token_ids: List[int]  # the generated tokens (EOS included when it ended the generation)
    stats: GenerationStats
    # generate_many(keep_features=True): the target's final hidden states of the prompt and the
    # generated tokens but the last, [n + len(token_ids) - 1, H] (a training set's features)
    features: Optional[torch.Tensor] = None



# ----------------------------------------------------------------------------- the loop
@dataclass
class _Settings:
    """What every sequence of a call shares."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos: set
    seed: int
    max_cache_len: Optional[int]
    keep_features: bool = False
    graphs: str = "eager"


class _Sequence:
    """One prompt in flight: what it emitted, its statistics and its own random draws (seeded
    with the call's seed plus its index, so it samples the same alone or in any batch)."""

    def __init__(self, index: int, ids: torch.Tensor, s: _Settings, limit: Optional[int], tree_nodes: int,
                 on_tokens: Optional[Callable[[List[int]], None]]):
        n = ids.numel()
        name = "the prompt" if index == 0 else f"prompt {index}"
        if limit is not None and n >= limit:
            raise ValueError(f"{name} has {n} tokens, but the target's context holds {limit} positions "
                             f"(max_position_embeddings): no room for a new token")
        self.budget = s.max_new_tokens if limit is None else min(s.max_new_tokens, limit - n)  # new tokens at positions < limit
        self.bound = n + self.budget + tree_nodes  # the most its KV cache rows can hold: committed tokens + one tree
        if s.max_cache_len is not None:
            if n + tree_nodes > s.max_cache_len:
                raise ValueError(f"{name} has {n} tokens; with a {tree_nodes}-node tree it needs a KV cache of at "
                                 f"least {n + tree_nodes} positions, but the cache holds {s.max_cache_len} (max_cache_len)")
            self.bound = min(self.bound, s.max_cache_len)
        self.index, self.ids, self.settings, self.on_tokens = index, ids, s, on_tokens
        self.generator = torch.Generator(device="cpu").manual_seed((s.seed + index) % 2**63)
        self.out: List[int] = []
        self.features: List[torch.Tensor] = []
        self.stats = GenerationStats()
        self.root = -1
        self.t0 = 0.0

    @property
    def done(self) -> bool:
        return bool(self.stats.stop_reason)

    def draws(self, count: int) -> torch.Tensor:
        return torch.rand(1, count, dtype=torch.float64, generator=self.generator)

    def emit(self, tokens: List[int]) -> None:
        """Append tokens up to EOS / the budget (then the sequence is done)."""
        s = self.settings
        for i, t in enumerate(tokens):
            if t in s.eos or len(self.out) + i + 1 == self.budget:
                tokens = tokens[: i + 1]
                self.stats.stop_reason = ("eos" if t in s.eos else "max_new_tokens" if self.budget == s.max_new_tokens
                                          else "context_limit")
                break
        self.out.extend(tokens)
        if self.on_tokens:
            self.on_tokens(tokens)

    def output(self) -> GenerationOutput:
        self.stats.wall_time_s = time.perf_counter() - self.t0
        self.stats.new_tokens = len(self.out)
        features = None
        if self.settings.keep_features:
            features = torch.cat(self.features)[: self.ids.numel() + len(self.out) - 1]
        return GenerationOutput(self.out, self.stats, features)


def _no_distribution() -> RuntimeError:
    return RuntimeError("the target's logits are not finite (NaN or inf): verification cannot choose a token "
                        "(check the model's weights and dtype)")


class _Batch:
    """The sequences decoding together, row b of every cache holding ``rows[b]`` (None: a free
    row). A finished sequence frees its row and a waiting request takes it in place (continuous
    batching); free rows ride along in the forwards (lengths held at 0) until they are more than
    the busy ones, when the caches are compacted: one copy for every halving, not one per finish."""

    def __init__(self, target: LlamaModel, draft: Optional[DraftHead], method: Method, tree: TreeConfig,
                 s: _Settings, max_rows: int):
        self.target, self.draft, self.method, self.tree, self.settings = target, draft, method, tree, s
        self.max_rows = max_rows
        self.tree_nodes = tree.max_nodes_for(method)
        self.device = target.lm_head.weight.device
        self.rows: List[Optional[_Sequence]] = []
        self.cache = None
        self.drafter: Optional[Drafter] = None
        self.root_parent = torch.tensor([[-1]], device=self.device)
        self.replay = None if s.graphs == "eager" else Replay(self._draft_and_verify, s.graphs)
        # The target's layers an EAGLE-3 head reads (None: its final hidden states, as the others)
        self.feature_layers = getattr(draft, "feature_layers", None) if method.head is not None else None

    @property
    def seqs(self) -> List[_Sequence]:
        """The sequences in flight."""
        return [seq for seq in self.rows if seq is not None]

    def check(self) -> None:
        """The drafter's checks of the method, head and tree, before any prompt is run."""
        Drafter.check(self.draft, self.method, self.tree)

    # ------------------------------------------------------------------ a sequence starts
    def _prefill(self, seq: _Sequence):
        """Run the prompt alone, choose the first token. Returns what loading its rows needs."""
        seq.t0 = time.perf_counter()
        ids = seq.ids.to(self.device)
        n = ids.numel()
        one = self.target.new_cache(1, n)
        logits, hidden = self.target(ids.unsqueeze(0), one, last_logits_only=True, feature_layers=self.feature_layers)
        one.commit(n)
        seq.stats.target_forwards += 1
        s = self.settings
        uniforms = seq.draws(2).to(self.device) if s.temperature > 0 else None
        _, accepted, bonus = ops.verify_tree(self.root_parent, ids[-1:].unsqueeze(0), logits, uniforms,
                                             s.temperature, s.top_p, s.top_k)
        device_errors, accepted_0, seq.root = torch.cat([ops.device_errors(logits).long(), accepted, bonus]).tolist()
        ops.raise_device_errors(device_errors)
        if accepted_0 < 0:  # the op's mark of a logit row it cannot use (on a GPU; on the CPU it raises)
            raise _no_distribution()
        if s.keep_features:
            seq.features.append(hidden[0])
        seq.stats.prefill_s = time.perf_counter() - seq.t0
        seq.emit([seq.root])
        return one, torch.cat([ids[1:], bonus]), hidden[0]

    def admit(self, pending: List[_Sequence]) -> List[_Sequence]:
        """Start the sequences ``pending`` (at most the free rows); returns those already done
        (their first token ended them), the others join the batch."""
        started, done = [], []
        for seq in pending:
            state = self._prefill(seq)
            (done if seq.done else started).append((seq, state))
        if started:
            self._add_rows([seq for seq, _ in started], [state for _, state in started])
        return [seq for seq, _ in done]

    def _add_rows(self, seqs: List[_Sequence], states) -> None:
        """Place started sequences in free rows, then in new ones."""
        room = max(min(seq.bound, seq.ids.numel() + INITIAL_ROOM + self.tree_nodes) for seq in seqs)
        bound = max(seq.bound for seq in seqs)
        free = [b for b, seq in enumerate(self.rows) if seq is None]
        extra = len(seqs) - len(free)
        if self.cache is None:
            self.drafter = Drafter(self.draft, self.method, self.tree, len(seqs), room, bound)
            self.cache = self.target.new_cache(len(seqs), room, bound)
            self.rows = [None] * len(seqs)
        elif extra > 0:
            rows = list(range(len(self.rows))) + [-1] * extra  # -1: a new row
            self.cache.select_rows(rows, bound)
            self.drafter.select_rows(rows, bound)
            self.rows += [None] * extra
        else:
            self.cache.allow(bound)
            self.drafter.allow(bound)
        free = [b for b, seq in enumerate(self.rows) if seq is None]
        for b, seq, (one, tokens, features) in zip(free, seqs, states):
            self.cache.load(b, one)
            before = self.drafter.forwards
            self.drafter.load(b, tokens, features)
            seq.stats.draft_forwards += self.drafter.forwards - before
            self.rows[b] = seq

    def drop_done(self) -> List[_Sequence]:
        """Free the rows of the finished sequences; returns them."""
        done = [seq for seq in self.rows if seq is not None and seq.done]
        self.rows = [None if seq is None or seq.done else seq for seq in self.rows]
        return done

    def compact(self) -> None:
        """Drop the free rows when they outnumber the busy ones (all of them when none is busy)."""
        busy = [b for b, seq in enumerate(self.rows) if seq is not None]
        if not busy:
            self.rows, self.cache, self.drafter = [], None, None
        elif len(self.rows) - len(busy) > len(busy):
            self.cache.select_rows(busy)
            self.drafter.select_rows(busy)
            self.rows = [self.rows[b] for b in busy]

    # ------------------------------------------------------------------ a round
    def round(self) -> None:
        """Draft, verify and commit once for every sequence of the batch. The host reads the
        device once: the accepted tokens, with the kernels' and the drafter's error flags."""
        s = self.settings
        for seq, length in zip(self.rows, self.cache.host_lengths):
            if seq is not None and length + self.tree_nodes > seq.bound:  # only a max_cache_len smaller than the need
                seq.stats.stop_reason = "cache_full"
        if any(seq.done for seq in self.seqs):
            return
        seqs, B = self.rows, len(self.rows)
        idle = [b for b, seq in enumerate(seqs) if seq is None]
        if idle:  # a free row computes a throw-away tree at position 0, never growing
            self.cache.clear(idle)
            self.drafter.reset_rows(idle)
        inputs = [ops.to_device(torch.tensor([seq.root if seq else 0 for seq in seqs]), self.device)]
        if s.temperature > 0:
            # Node i of a sequence's tree uses its i-th draw, the bonus token its last: a sequence
            # draws the same whatever the round's padded tree size (set by the other sequences).
            draws = torch.full((B, self.tree_nodes + 1), 0.5, dtype=torch.float64)  # free rows: never read
            for b, seq in enumerate(seqs):
                if seq is not None:
                    draws[b] = seq.draws(self.tree_nodes + 1)[0]
            inputs.append(ops.to_device(draws, self.device))
        root_step = [] if self.drafter.root_step is None else [t for t in self.drafter.root_step if t is not None]
        # What the device part may write beyond the committed tokens (a replay cannot grow a cache).
        self.cache.reserve(max(self.cache.host_lengths) + self.tree_nodes)
        self.drafter.reserve()
        if self.replay is None:
            (path, accepted, tokens, hidden, read), drafted = self._draft_and_verify(*inputs, *root_step)
        else:
            key = (B, s.temperature > 0, *(t.data_ptr() for t in self._buffers()))
            (path, accepted, tokens, hidden, read), drafted = self.replay(key, inputs + root_step)
        read = read.tolist()
        ops.raise_device_errors(read[0])
        for message, flagged in zip(DRAFT_ERRORS, read[1:]):
            if flagged:
                raise RuntimeError(message)
        width, first = tokens.shape[1], 1 + len(DRAFT_ERRORS)
        read = [read[first + b * (width + 1): first + (b + 1) * (width + 1)] for b in range(B)]
        accepted_list = [r[0] for r in read]
        if min(accepted_list) < 0:
            raise _no_distribution()
        counts = [a + 1 for a in accepted_list]
        self.cache.commit_path(path, accepted + 1, counts)
        # With the target's hidden states at the root and the accepted nodes, they are the draft's catch-up.
        n = max(counts)
        index = path[:, :n].clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        features = hidden.gather(1, index)
        forwards = self.drafter.forwards
        self.drafter.catch_up(tokens[:, :n], features, counts)
        drafted += self.drafter.forwards - forwards
        for b, (seq, a, row) in enumerate(zip(seqs, accepted_list, (r[1:] for r in read))):
            if seq is None:
                continue
            seq.stats.target_forwards += 1
            seq.stats.draft_forwards += drafted
            seq.stats.accept_lengths.append(a)
            if s.keep_features:
                seq.features.append(features[b, : a + 1])
            seq.root = row[a]
            seq.emit(row[: a + 1])

    def _draft_and_verify(self, roots: torch.Tensor, *rest: torch.Tensor):
        """The round's device work, from the roots [B] (and with sampling the draws [B, nodes + 1])
        and the drafter's root step (its non-None tensors) to what the host reads: a function of
        these tensors and of the caches alone, with no read of the device, so a CUDA graph can
        replay it (:mod:`jakiro_ext.graphs`). Returns ((path, accepted, tokens [B, width],
        hidden, read), the draft forwards it ran); ``read`` packs the device's error word, the
        drafter's error flags and each row's accepted count then its tokens."""
        s = self.settings
        draws, root_step = (rest[0], rest[1:]) if s.temperature > 0 else (None, rest)
        if root_step:
            fields = iter(root_step)
            self.drafter.root_step = DraftStep(*(None if t is None else next(fields) for t in self.drafter.root_step))
        forwards = self.drafter.forwards
        tree = self.drafter.draft(roots)
        logits, hidden = self.target(tree.tokens, self.cache, ops.build_tree_mask(tree.parents, check=False), tree.depths,
                                     feature_layers=self.feature_layers)
        T = tree.tokens.shape[1]
        uniforms = None if draws is None else torch.cat([draws[:, :T], draws[:, -1:]], 1)
        path, accepted, bonus = ops.verify_tree(tree.parents, tree.tokens, logits, uniforms, s.temperature,
                                                s.top_p, s.top_k)
        # Each sequence's new tokens: its accepted drafts, then the bonus (row b: accepted[b] + 1 of them).
        tokens = torch.cat([tree.tokens.gather(1, path[:, 1:].clamp(min=0)), torch.zeros_like(bonus).unsqueeze(1)], 1)
        tokens.scatter_(1, accepted.clamp(min=0).unsqueeze(1), bonus.unsqueeze(1))
        errors = tree.errors if tree.errors is not None else torch.zeros(len(DRAFT_ERRORS), dtype=torch.bool,
                                                                         device=roots.device)
        read = torch.cat([ops.device_errors(logits).long(), errors.long(),
                          torch.cat([accepted.unsqueeze(1), tokens], 1).flatten()])
        return (path, accepted, tokens, hidden, read), self.drafter.forwards - forwards

    def _buffers(self) -> List[torch.Tensor]:
        """The long-lived tensors a capture of the round points to: a new one means a new capture."""
        found = [self.cache.kv, self.cache.lengths]
        if self.drafter.cache is not None:
            found += [self.drafter.cache.kv, self.drafter.cache.lengths]
        return found


def _decode(target, draft, method: Method, tree: TreeConfig, s: _Settings, requests, max_rows: int):
    """Decode the sequences ``requests`` gives (asked whenever a row is free: an iterator that
    ran dry may have more later), up to ``max_rows`` at once; yields each (sequence, output) as
    it finishes."""
    batch = _Batch(target, draft, method, tree, s, max_rows)
    batch.check()
    while True:
        while len(batch.seqs) < max_rows:  # free rows take waiting requests
            pending = []
            while len(batch.seqs) + len(pending) < max_rows and (seq := next(requests, None)) is not None:
                pending.append(seq)
            if not pending:
                break
            for seq in batch.admit(pending):  # done at their first token
                yield seq, seq.output()
        batch.compact()
        if not batch.seqs:
            return
        batch.round()
        for seq in batch.drop_done():
            yield seq, seq.output()


def _settings(target, draft, method, tree, max_new_tokens, temperature, top_p, top_k, eos_token_id, seed,
              max_cache_len, on_tokens, keep_features: bool = False, graphs: str = "eager"):
    """The checked arguments shared by the entry points: (Method, _Settings)."""
    if draft is not None and not isinstance(draft, DraftHead):
        raise TypeError(f"draft must be a DraftHead or None, got {type(draft).__name__}")
    max_new_tokens, temperature, top_p, top_k, seed = check_sampling_options(max_new_tokens, temperature, top_p,
                                                                             top_k, seed)
    eos = _eos_ids(eos_token_id)
    if max_cache_len is not None:
        max_cache_len = _int_arg("max_cache_len", max_cache_len, 1)
    if method is not None and not isinstance(method, str):
        raise TypeError(f"method must be a str (one of {METHODS}), got {type(method).__name__} {_brief(method)}")
    if tree is not None and not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__} {_brief(tree)}")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be None or a callable, got {type(on_tokens).__name__}")
    if method is None:
        kind = draft.config.kind if draft is not None else "ar"
        method = {"jakiro_gumiho": "gumiho", "eagle3": "eagle2"}.get(kind, kind)
    if method not in METHOD_SPECS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    spec = METHOD_SPECS[method]
    if spec.head is not None and draft is None:
        raise ValueError(f"method {method!r} needs a draft head")
    if graphs not in GRAPH_MODES:
        raise ValueError(f"graphs must be one of {GRAPH_MODES}, got {_brief(graphs)}")
    if graphs == "cuda" and target.lm_head.weight.device.type != "cuda":
        raise ValueError(f"graphs='cuda' needs the target on a CUDA device, it is on {target.lm_head.weight.device}")
    return spec, _Settings(max_new_tokens, temperature, top_p, top_k, eos, seed, max_cache_len, keep_features, graphs)


def default_tree(target, draft, method, tree: Optional[TreeConfig] = None, batch: int = 1) -> TreeConfig:
    """The tree given, else on CPU the one chosen by measured cost for ``batch`` sequences (for a
    head with an acceptance profile) or CPU_TREE, elsewhere GPU_TREE (deepened to a serial step
    and the head's MLP heads for ``gumiho``). ``method``: a name or a :class:`Method`."""
    method = METHOD_SPECS[method] if isinstance(method, str) else method
    device = target.lm_head.weight.device
    if tree is None and device.type == "cpu" and method.head is not None:
        from jakiro_ext.tree_cost import auto_tree

        tree = auto_tree(target, draft, method.name, batch)
    if tree is None:
        tree = CPU_TREE if device.type == "cpu" else GPU_TREE
        if method.parallel_heads and draft is not None:  # a serial step, then one layer per MLP head
            tree = replace(tree, depth=max(tree.depth, draft.config.num_mlp_heads + 1))
    return tree


_DOC_OPTIONS = """
    method : ``ar`` (plain decoding), ``eagle2`` (dynamic tree, autoregressive drafting),
        ``jakiro`` (the last layer from the contrastive branch, one draft forward fewer) or
        ``jakiro_star`` (each activated expert proposes its own children) or ``gumiho`` (serial
        steps, then the head's parallel MLP heads draft one layer each, in one pass; depth >= the
        MLP heads + 1). Default: the head's kind (``jakiro`` for a MoE head, ``gumiho`` for one
        with MLP heads, ``eagle2`` for a dense one), ``ar`` without a head.
    tree : a :class:`TreeConfig`. Default on CPU: chosen by measured cost for a head with an
        acceptance profile, at the call's batch size (:mod:`jakiro_ext.tree_cost`; the machine's
        costs are measured once per batch-size bucket and cached), else :data:`CPU_TREE`;
        elsewhere :data:`GPU_TREE`.
    temperature, top_p, top_k : finite temperature >= 0 (0: greedy), top_p in (0, 1], int top_k >= 0 (0: off).
    eos_token_id : None, an int or a list of ints that end a generation (included in the output).
    seed : an int in [0, 2**63): seeds the draws of sampling (temperature > 0); sequence i of a
        call draws from its own generator seeded with seed + i, so its draws do not depend on
        the other sequences (with the same trees it samples the same tokens alone, given that seed).
    max_cache_len : None or a bound (>= 1) on each sequence's KV cache positions; a generation
        stops with ``stop_reason`` "cache_full" when it runs out. Either way the caches start
        small and grow on demand, up to prompt + the tokens left to generate + the largest tree
        the method can draft (:meth:`TreeConfig.max_nodes_for`).
    graphs : how a round's device work (drafting, verification forward, verification) is
        launched: ``"eager"`` (op by op, the default), ``"cuda"`` (captured once as a CUDA graph
        per batch size and cache buffer, then replayed: one launch instead of hundreds; a CUDA
        target only) or ``"recorded"`` (the same capture-and-replay rules, run by replaying the
        recorded ops on any device: for tests and debugging). Every mode gives the same tokens
        (:mod:`jakiro_ext.graphs`).
"""


def speculative_generate(target: LlamaModel, draft: Optional[DraftHead], input_ids, max_new_tokens: int = 128, *,
                         lengths=None, method: Optional[str] = None, tree: Optional[TreeConfig] = None,
                         temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_id=None,
                         seed: int = 0, max_cache_len: Optional[int] = None, on_tokens: Optional[Callable] = None,
                         graphs: str = "eager"):
    """Generate up to ``max_new_tokens`` tokens after each prompt, losslessly: at temperature 0
    the tokens are the target's greedy ones; above it they follow the target's distribution
    (after temperature, top-k, top-p).

    Parameters
    ----------
    target : the target model: a :class:`LlamaModel`, or a transformers ``*ForCausalLM`` of a
        supported family (Llama, Mistral, Qwen2), converted once and cached (:func:`as_target`).
    draft : a draft head bound to ``target`` (``DraftHead.load(path, target)``); None for ``ar``.
    input_ids : one prompt (a list of ints, an integer tensor [n] or [1, n]), or a batch of
        prompts of any lengths (a list of such prompts, or an integer tensor [B, n] with
        ``lengths``), of token ids of the target's vocabulary, decoded together. Each must leave room for one new
        token in the target's context (``target.config.max_position_embeddings``).
    max_new_tokens : an int >= 1 (one for every sequence). No token is generated at a position
        beyond the context limit: when the limit comes first, the generation ends there
        (``stop_reason`` "context_limit").
    lengths : with a [B, n] tensor of prompts, each one's length (the rest of its row is padding);
        default: every row is a whole prompt.""" + _DOC_OPTIONS + """    on_tokens : None or a callable, called with each batch of newly emitted tokens (streaming):
        ``on_tokens(tokens)`` for one prompt, ``on_tokens(i, tokens)`` for prompt i of a batch
        (the calls that return a list).

    Returns
    -------
    A :class:`GenerationOutput` for one prompt, a list of them (in order) for a batch of two or
    more prompts, or for any prompts given with ``lengths``.

    Raises
    ------
    TypeError, ValueError : a bad argument (the message names it), before anything is allocated.
    RuntimeError : the target's or the draft head's logits are not finite (NaN or inf); no token
        is ever emitted that the target did not give.
    MemoryError : a KV cache could not be allocated (the message says how many bytes).
    """
    target = as_target(target)
    method, s = _settings(target, draft, method, tree, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                          seed, max_cache_len, on_tokens, graphs=graphs)
    prompts, batched = _prompts(input_ids, lengths, target.config.vocab_size)
    tree = default_tree(target, draft, method, tree, len(prompts))
    nodes, limit = tree.max_nodes_for(method), target.config.max_position_embeddings

    def stream(i):
        if on_tokens is None:
            return None
        return (lambda tokens: on_tokens(i, tokens)) if batched else on_tokens

    seqs = [_Sequence(i, ids, s, limit, nodes, stream(i)) for i, ids in enumerate(prompts)]
    outputs = {seq.index: out for seq, out in _decode(target, draft, method, tree, s, iter(seqs), len(seqs))}
    return [outputs[i] for i in range(len(seqs))] if batched else outputs[0]


def generate_many(target: LlamaModel, draft: Optional[DraftHead], requests, max_batch_size: int = 8,
                  max_new_tokens: int = 128, *, method: Optional[str] = None, tree: Optional[TreeConfig] = None,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_id=None, seed: int = 0,
                  max_cache_len: Optional[int] = None, on_tokens: Optional[Callable] = None,
                  keep_features: bool = False, graphs: str = "eager") -> Iterator[Tuple[int, GenerationOutput]]:
    """Continuous batching: decode the prompts of ``requests`` with up to ``max_batch_size`` in
    flight, a finished one's rows taken by the next prompt; yields (i, output) for the i-th
    prompt as each finishes. Each prompt gets exactly what ``speculative_generate`` gives it alone
    (greedy; at temperature > 0 it draws from its own generator, seeded with seed + i), whatever
    the order of arrival and the number in flight.

    Parameters
    ----------
    requests : an iterable of prompts (lists of ints or integer tensors [n]), asked for the next
        one whenever a row is free; an iterator that ran dry is asked again later (it may have
        more by then: follow-up turns queued as answers finish), the generation ending when it
        has nothing while no sequence is in flight. A bad prompt raises when it is reached.
    max_batch_size : sequences decoded at once, in [1, MAX_BATCH].
    max_new_tokens, method, tree, temperature, top_p, top_k, eos_token_id, seed, max_cache_len, graphs :
        as for :func:`speculative_generate`, one setting for every prompt.
    on_tokens : None or a callable ``on_tokens(i, tokens)`` (streaming).
    keep_features : also return the target's hidden states (``GenerationOutput.features``).
    """
    target = as_target(target)
    method, s = _settings(target, draft, method, tree, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                          seed, max_cache_len, on_tokens, bool(keep_features), graphs)
    max_batch_size = _int_arg("max_batch_size", max_batch_size, 1, MAX_BATCH)
    tree = default_tree(target, draft, method, tree, max_batch_size)
    nodes, limit, vocab = tree.max_nodes_for(method), target.config.max_position_embeddings, target.config.vocab_size
    return _generate_many(target, draft, method, tree, s, iter(requests), max_batch_size, nodes, limit, vocab,
                          on_tokens)


class _Arrivals:
    """The requests as checked sequences, numbered in order of arrival; asking again after it ran
    dry asks the underlying iterator again."""

    def __init__(self, requests, s, limit, nodes, vocab, on_tokens):
        self.requests, self.s, self.limit, self.nodes, self.vocab, self.on_tokens = requests, s, limit, nodes, vocab, on_tokens
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self) -> _Sequence:
        prompt = next(self.requests, None)
        if prompt is None:
            raise StopIteration
        i = self.count
        ids = _prompt_ids(prompt, self.vocab, f"request {i}")
        self.count += 1
        stream = None if self.on_tokens is None else (lambda tokens: self.on_tokens(i, tokens))
        return _Sequence(i, ids, self.s, self.limit, self.nodes, stream)


def _generate_many(target, draft, method, tree, s, requests, max_batch_size, nodes, limit, vocab, on_tokens):
    arrivals = _Arrivals(requests, s, limit, nodes, vocab, on_tokens)
    for seq, out in _decode(target, draft, method, tree, s, arrivals, max_batch_size):
        yield seq.index, out
