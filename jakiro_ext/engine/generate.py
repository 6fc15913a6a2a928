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

import numbers
from typing import Callable, Iterator, Optional, Sized, Tuple

import torch

from jakiro_ext.config import MAX_BATCH, TreeConfig, brief, check_sampling_options, int_arg
from jakiro_ext.engine import graph_sessions
from jakiro_ext.engine.batch import DecodeBatch
from jakiro_ext.engine.graphs import MODES
from jakiro_ext.engine.sequence import DecodeSequence, DecodeSettings, GenerationOutput, check_room
from jakiro_ext.engine.policy import TreePolicy, largest_tree, tree_policy
from jakiro_ext.methods import METHOD_NAMES, METHODS, Method, method_for_head
from jakiro_ext.models.heads.head import Head
from jakiro_ext.models.llama import LlamaModel, as_target

GRAPH_MODES = ("eager", *MODES)  # how a round's device work is launched (speculative_generate's graphs)


def _prompt_ids(input_ids, vocab: int, name: str = "input_ids") -> torch.Tensor:
    """One prompt as an int64 [n] tensor: from a list of ints or a 1-D integer tensor, non-empty,
    every id in the target's vocabulary."""
    if isinstance(input_ids, (list, tuple)):
        bad = [x for x in input_ids if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
        if bad:
            raise TypeError(f"{name} must be ints (token ids), got {type(bad[0]).__name__} {brief(bad[0])}")
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
            raise ValueError(f"lengths must give one length per row of input_ids ({B}), got {brief(lengths)}")
        lengths = [int_arg(f"lengths[{b}]", x, 1, n) for b, x in enumerate(lengths)]
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
                        f"{brief(eos_token_id)}")
    return {int(x) for x in values}


def _decode(target, draft, method: Method, policy: TreePolicy, s: DecodeSettings, requests, max_rows: int,
            listed: Optional[Sized] = None):
    """Decode the sequences ``requests`` gives (asked whenever a row is free: an iterator that
    ran dry may have more later), up to ``max_rows`` at once; yields each (sequence, output) as
    it finishes. Each round runs the tree ``policy`` chooses. ``listed``: the collection
    ``requests`` iterates over, when it is one (the batch drains once as many are taken as it
    holds: its length read each round, so prompts appended to it count)."""
    session = None if s.graphs == "eager" else graph_sessions.take(target, draft, method, policy.trees, s, max_rows)
    try:
        batch = DecodeBatch(target, draft, method, policy, s, max_rows, session)  # checks the method, head and tree
        try:
            yield from _rounds(batch, policy, requests, max_rows, listed)
        finally:
            batch.close()
    finally:
        if session is not None:
            graph_sessions.give_back(session)


def _rounds(batch: DecodeBatch, policy: TreePolicy, requests, max_rows: int, listed: Optional[Sized]):
    """:func:`_decode`'s rounds: admit the waiting requests to free rows, run a round, yield the
    finished sequences, until none is in flight and none waits."""
    taken, dry = 0, False
    while True:
        while len(batch.seqs) < max_rows:  # free rows take waiting requests
            pending = []
            while len(batch.seqs) + len(pending) < max_rows and (seq := next(requests, None)) is not None:
                pending.append(seq)
            dry, taken = len(batch.seqs) + len(pending) < max_rows, taken + len(pending)  # (asked, found none)
            if not pending:
                break
            for seq in batch.admit(pending):  # done at their first token
                yield seq, seq.output()
        # No request waits for a row: the call ends with its slowest sequence (DecodeBatch.round).
        batch.draining = dry or (listed is not None and taken >= len(listed))
        batch.compact()
        if not batch.seqs:
            policy.end_call()
            return
        batch.round()
        for seq in batch.drop_done():
            yield seq, seq.output()


def _settings(target, draft, method, tree, max_new_tokens, temperature, top_p, top_k, eos_token_id, seed,
              max_cache_len, on_tokens, keep_features: bool = False, graphs: str = "eager"):
    """The checked arguments shared by the entry points: (Method, DecodeSettings)."""
    if draft is not None and not isinstance(draft, Head):
        raise TypeError(f"draft must be a draft head (DraftHead, Eagle3Head) or None, got {type(draft).__name__}")
    max_new_tokens, temperature, top_p, top_k, seed = check_sampling_options(max_new_tokens, temperature, top_p,
                                                                             top_k, seed)
    eos = _eos_ids(eos_token_id)
    if max_cache_len is not None:
        max_cache_len = int_arg("max_cache_len", max_cache_len, 1)
    if method is not None and not isinstance(method, str):
        raise TypeError(f"method must be a str (one of {METHOD_NAMES}), got {type(method).__name__} {brief(method)}")
    if tree is not None and not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__} {brief(tree)}")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be None or a callable, got {type(on_tokens).__name__}")
    if method is None:
        method = method_for_head(draft.config.kind if draft is not None else None).name
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHOD_NAMES}, got {method!r}")
    spec = METHODS[method]
    if spec.drafts and draft is None:
        raise ValueError(f"method {spec.name!r} needs a draft head")
    if graphs not in GRAPH_MODES:
        raise ValueError(f"graphs must be one of {GRAPH_MODES}, got {brief(graphs)}")
    if graphs == "cuda" and target.lm_head.weight.device.type != "cuda":
        raise ValueError(f"graphs='cuda' needs the target on a CUDA device, it is on {target.lm_head.weight.device}")
    return spec, DecodeSettings(max_new_tokens, temperature, top_p, top_k, eos, seed, max_cache_len, keep_features, graphs)


_DOC_OPTIONS = """
    method : ``ar`` (plain decoding), ``eagle2`` (dynamic tree, autoregressive drafting),
        ``jakiro`` (the last layer from the contrastive branch, one draft forward fewer) or
        ``jakiro_star`` (each activated expert proposes its own children) or ``gumiho`` (serial
        steps, then the head's parallel MLP heads draft one layer each, in one pass; depth >= the
        MLP heads + 1). Default: the head's kind (``jakiro`` for a MoE head, ``gumiho`` for one
        with MLP heads, ``eagle2`` for a dense one), ``ar`` without a head.
    tree : a :class:`TreeConfig`. Default for a head with an acceptance profile: chosen
        round by round from live timing among the trees the cost model ranks best at the call's
        batch size and plain decoding (:mod:`jakiro_ext.engine.adaptive`; the machine's costs are
        measured once per batch-size bucket and cached, and measured again when live timing
        disagrees), so speculation never runs slower than plain decoding for long; with
        sampling a seed then fixes the distribution, not the tokens (pass a tree to fix both);
        with graphs too (a round that captures its graph is not timed). Else :data:`CPU_TREE` on
        CPU, :data:`GPU_TREE` elsewhere.
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
        (:mod:`jakiro_ext.engine.graphs`). A graphed call leaves its captures, drafters and cache
        buffers with the target for the next call of the same head, method, tree, batch size and
        sampling settings, which replays them without capturing again (at most two such sets
        a target, :mod:`jakiro_ext.engine.graph_sessions`; ``jakiro_ext.engine.free_graphs(target)``
        lets them go).
"""


def speculative_generate(target: LlamaModel, draft: Optional[Head], input_ids, max_new_tokens: int = 128, *,
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
    policy = tree_policy(target, draft, method, tree, len(prompts), s.temperature > 0, s.graphs)
    nodes, limit = largest_tree(policy, method).max_nodes_for(method), target.config.max_position_embeddings

    def stream(i):
        if on_tokens is None:
            return None
        return (lambda tokens: on_tokens(i, tokens)) if batched else on_tokens

    seqs = [DecodeSequence(i, ids, s, limit, nodes, stream(i)) for i, ids in enumerate(prompts)]
    outputs = {seq.index: out for seq, out in _decode(target, draft, method, policy, s, iter(seqs), len(seqs), seqs)}
    return [outputs[i] for i in range(len(seqs))] if batched else outputs[0]


def generate_many(target: LlamaModel, draft: Optional[Head], requests, max_batch_size: int = 8,
                  max_new_tokens: int = 128, *, method: Optional[str] = None, tree: Optional[TreeConfig] = None,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_id=None, seed: int = 0,
                  max_cache_len: Optional[int] = None, on_tokens: Optional[Callable] = None,
                  keep_features: bool = False, graphs: str = "eager") -> Iterator[Tuple[int, GenerationOutput]]:
    """Continuous batching: decode the prompts of ``requests`` with up to ``max_batch_size`` in
    flight, a finished one's rows taken by the next prompt; yields (i, output) for the i-th
    prompt as each finishes. Each prompt gets exactly what ``speculative_generate`` gives it alone
    (greedy; at temperature > 0 with a given ``tree`` it draws from its own generator, seeded with
    seed + i), whatever the order of arrival and the number in flight.

    Parameters
    ----------
    requests : an iterable of prompts (lists of ints or integer tensors [n]), asked for the next
        one whenever a row is free; an iterator that ran dry is asked again later (it may have
        more by then: follow-up turns queued as answers finish), the generation ending when it
        has nothing while no sequence is in flight. A bad prompt raises when it is reached. A
        list or tuple also says when none is left to wait for a row (its length read as it goes),
        which the tree chosen live uses (:meth:`DecodeBatch._progress`).
    max_batch_size : sequences decoded at once, in [1, MAX_BATCH].
    max_new_tokens, method, tree, temperature, top_p, top_k, eos_token_id, seed, max_cache_len, graphs :
        as for :func:`speculative_generate`, one setting for every prompt.
    on_tokens : None or a callable ``on_tokens(i, tokens)`` (streaming).
    keep_features : also return the target's hidden states (``GenerationOutput.features``).
    """
    target = as_target(target)
    method, s = _settings(target, draft, method, tree, max_new_tokens, temperature, top_p, top_k, eos_token_id,
                          seed, max_cache_len, on_tokens, bool(keep_features), graphs)
    max_batch_size = int_arg("max_batch_size", max_batch_size, 1, MAX_BATCH)
    limit, vocab = target.config.max_position_embeddings, target.config.vocab_size
    if isinstance(requests, (list, tuple)):  # every request checked before the tree policy measures anything
        for i, prompt in enumerate(requests):
            name = "the prompt" if i == 0 else f"prompt {i}"  # (as DecodeSequence names it)
            check_room(name, _prompt_ids(prompt, vocab, f"request {i}").numel(), limit)
    policy = tree_policy(target, draft, method, tree, max_batch_size, s.temperature > 0, s.graphs)
    nodes = largest_tree(policy, method).max_nodes_for(method)
    listed = requests if isinstance(requests, (list, tuple)) else None
    return _generate_many(target, draft, method, policy, s, iter(requests), max_batch_size, nodes, limit, vocab,
                          on_tokens, listed)


class _Arrivals:
    """The requests as checked sequences, numbered in order of arrival; asking again after it ran
    dry asks the underlying iterator again."""

    def __init__(self, requests, s, limit, nodes, vocab, on_tokens):
        self.requests, self.s, self.limit, self.nodes, self.vocab, self.on_tokens = requests, s, limit, nodes, vocab, on_tokens
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self) -> DecodeSequence:
        prompt = next(self.requests, None)
        if prompt is None:
            raise StopIteration
        i = self.count
        ids = _prompt_ids(prompt, self.vocab, f"request {i}")
        self.count += 1
        stream = None if self.on_tokens is None else (lambda tokens: self.on_tokens(i, tokens))
        return DecodeSequence(i, ids, self.s, self.limit, self.nodes, stream)


def _generate_many(target, draft, method, policy, s, requests, max_batch_size, nodes, limit, vocab, on_tokens,
                   listed=None):
    arrivals = _Arrivals(requests, s, limit, nodes, vocab, on_tokens)
    for seq, out in _decode(target, draft, method, policy, s, arrivals, max_batch_size, listed):
        yield seq.index, out
