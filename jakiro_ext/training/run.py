"""What a training run does around the loop (:func:`jakiro_ext.training.train.train_head`): read its
examples (a token corpus's, features cached, or an older feature set), hold some out, build the
head to train, and summarise the run (the ``training.json`` saved with the head). The ``train``
command (:mod:`jakiro_ext.cli.train`) calls these in order and reports its progress."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from jakiro_ext import atomic
from jakiro_ext.models.heads.config import MOE_KINDS, DraftConfig, default_feature_layers
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.eagle3 import Eagle3Config, Eagle3Head
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.paths import cache_root
from jakiro_ext.training.corpus import CORPUS_META
from jakiro_ext.training.distributed import Ranks
from jakiro_ext.training.examples import Example
from jakiro_ext.training.feature_cache import feature_cache_dir
from jakiro_ext.training import eagle3
from jakiro_ext.training.features import corpus_examples, prefill_features, uncached_feature_tokens
from jakiro_ext.training.settings import TrainConfig, compute_dtype
from jakiro_ext.training.trainset import build_trainset, load_trainset, select_draft_vocab


@dataclass
class TrainingData:
    """A run's examples, what they are (``meta``: settings, sequences, tokens, learned tokens),
    where they are, and whether that is a token corpus (whose features are cached)."""
    examples: List[Example]
    meta: dict
    directory: Path
    corpus: bool
    feature_dtype: torch.dtype = torch.float32

    @property
    def feature_dir(self) -> Optional[Path]:
        """Where a corpus's features (and the token loss's cached labels) are kept."""
        return feature_cache_dir(self.directory, self.feature_dtype) if self.corpus else None

    def split(self, every_nth: int) -> Tuple[List[Example], List[Example]]:
        """(training, held-out) examples: every n-th conversation held out (none for n = 0), by
        conversation because a conversation's later turns contain its earlier ones."""
        held_out = [ex for ex in self.examples if every_nth and ex.conversation % every_nth == 0]
        train = [ex for ex in self.examples if not every_nth or ex.conversation % every_nth]
        return train, held_out


def is_corpus(data: Optional[str]) -> bool:
    return bool(data and (Path(data) / CORPUS_META).exists())


def read_training_data(data: Optional[str], target: LlamaModel, tokenizer, target_name: str, ranks: Ranks,
                       shards: Optional[int] = None, source: str = "self_distill", max_tokens: int = 0,
                       max_prompt_tokens: int = 0, max_new_tokens: int = 0, generation_batch: int = 0,
                       conversations: Optional[str] = None, feature_dtype: torch.dtype = torch.float32) -> TrainingData:
    """The examples of ``data``: a token corpus (its first ``shards``; the features not yet cached
    computed, after checking there is room for them), else an older feature set, built first
    (by rank 0; the others wait) when missing, from ``source`` and the build settings.
    ``feature_dtype``: what a corpus's features are computed in (:func:`corpus_examples`)."""
    progress = ranks.rank == 0
    if is_corpus(data):
        directory = Path(data)
        missing = uncached_feature_tokens(directory, shards=shards, dtype=feature_dtype)
        if missing and progress:
            atomic.check_output_dir(feature_cache_dir(directory, feature_dtype), 2 * target.config.hidden_size * missing,
                                    f"the bf16 features of {missing} corpus tokens not yet in the cache")
        examples, corpus_meta = corpus_examples(directory, target, progress=progress, ranks=ranks, shards=shards,
                                                dtype=feature_dtype)
        meta = dict(settings=dict(corpus_meta["settings"], corpus=str(directory)), shards=len(corpus_meta["shards"]),
                    sequences=len(examples), tokens=sum(int(ex.tokens.numel()) for ex in examples),
                    learned_tokens=sum(int(ex.loss_mask.sum()) for ex in examples),
                    feature_dtype=str(feature_dtype).replace("torch.", ""))
        return TrainingData(examples, meta, directory, True, feature_dtype)
    directory = Path(data or cache_root() / "trainsets" / f"{target_name}-{source}")
    if progress:
        build_trainset(directory, target, tokenizer, target_name, source, max_tokens, max_prompt_tokens,
                       max_new_tokens, generation_batch, conversations)
    ranks.barrier()
    examples, meta = load_trainset(directory)
    return TrainingData(examples, meta, directory, False)


def new_head(target: LlamaModel, target_name: str, kind: str, train: Sequence[Example], eos: Sequence[int] = (),
             experts: int = 8, intermediate_size: int = 0, layers: int = 1, mlp_heads: int = 0, mlp_blocks: int = 0,
             draft_vocab: int = 0, seed: int = 0, init_from_target: bool = False,
             init_from: Optional[str] = None, feature_layers: Sequence[int] = ()) -> Tuple[DraftHead, float]:
    """(the head to train, bound to ``target``; the share of the learned tokens its draft
    vocabulary covers). Default widths: a dense MLP as wide as the target's, N experts that
    together hold the same parameters (each target_intermediate / N wide), so both heads are the
    same size. A reduced draft vocabulary is the ``draft_vocab`` tokens most learned in ``train``
    (and ``eos``). ``init_from``: continue from a trained head of the same config, keeping its draft
    vocabulary (the data may be other than the one it was trained on). ``feature_layers``: a fused
    head, reading those target layers (:class:`DraftHead`)."""
    width = intermediate_size or (target.config.intermediate_size // (experts if kind in MOE_KINDS else 1))
    config = DraftConfig.for_target(target.config, kind, num_experts=experts, intermediate_size=width,
                                    target_name=target_name, num_layers=layers, num_mlp_heads=mlp_heads,
                                    mlp_blocks=mlp_blocks, feature_layers=feature_layers)
    config.draft_vocab_size = draft_vocab
    head = DraftHead(config, init=False).init_weights(seed=seed)
    coverage = 1.0
    start = DraftHead.load(init_from) if init_from else None
    if draft_vocab:
        if start is not None and start.config.draft_vocab_size == draft_vocab:
            # Continuing a head keeps the vocabulary its LM head rows were trained on, whatever
            # this run's data would select.
            ids = start.draft_to_target.cpu()
            learned = torch.cat([ex.tokens[ex.loss_mask] for ex in train])
            coverage = float(torch.isin(learned, ids).double().mean())
        else:
            ids, coverage = select_draft_vocab(train, draft_vocab, list(eos))
        head.set_draft_vocab(ids)
    if init_from_target:
        head.init_from_target(target)
    if start is not None:
        if start.config != head.config:
            raise ValueError(f"--init-from {init_from}: its config differs from this run's "
                             f"(there: {start.config}; here: {head.config}); give the same kind, widths and "
                             "draft vocabulary size")
        head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in start.state_dict().items()})
    return head.bind(target), coverage


def new_eagle3_head(target: LlamaModel, target_name: str, train: Sequence[Example], eos: Sequence[int] = (),
                    draft_vocab: int = 0, seed: int = 0, intermediate_size: int = 0,
                    layers: Sequence[int] = ()) -> Tuple[Eagle3Head, float]:
    """(an EAGLE-3 head to train, bound to ``target``; the share of the learned tokens its draft
    vocabulary covers): the target's attention shape and MLP width (``intermediate_size`` if
    given), reading the residual streams entering ``layers`` (default 2, L / 2, L - 3, as vLLM),
    over the ``draft_vocab`` tokens most learned in ``train`` (and ``eos``; 0: the whole
    vocabulary), its LM head started from the target's rows of them, the rest random."""
    c = target.config
    config = Eagle3Config(hidden_size=c.hidden_size, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab or c.vocab_size,
                          num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                          intermediate_size=intermediate_size or c.intermediate_size, rope_theta=c.rope_theta,
                          rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings or 2048,
                          feature_layers=list(layers or default_feature_layers(c.num_layers)), target=target_name)
    head = eagle3.init_weights(Eagle3Head(config), seed)
    ids, coverage = select_draft_vocab(train, draft_vocab, list(eos)) if draft_vocab else (torch.arange(c.vocab_size), 1.0)
    head.draft_to_target.copy_(ids)
    head.bind(target)
    eagle3.init_lm_head(head, target.lm_head.weight.detach()[ids.to(target.lm_head.weight.device)])
    return head, coverage


def use_layer_features(data: TrainingData, target: LlamaModel, layers: Sequence[int], ranks: Ranks) -> None:
    """Give every example the residual streams entering the target's ``layers`` as its features
    ([n, 3H], an EAGLE-3 head's input) in place of the final hidden states (which its labels
    came from: attach them first): a corpus's from their own cache (computed once), other
    examples' by prefill."""
    layers = tuple(layers)
    if data.corpus:
        feature_dir = feature_cache_dir(data.directory, data.feature_dtype, layers)
        missing = uncached_feature_tokens(data.directory, feature_dir, data.meta["shards"], data.feature_dtype)
        if missing and ranks.rank == 0:
            atomic.check_output_dir(feature_dir, 2 * len(layers) * target.config.hidden_size * missing,
                                    f"the features of layers {list(layers)} of {missing} corpus tokens")
        layered, _ = corpus_examples(data.directory, target, progress=ranks.rank == 0, ranks=ranks,
                                     shards=data.meta["shards"], dtype=data.feature_dtype, feature_layers=layers)
        features = [ex.features for ex in layered]
        if [ex.tokens.numel() for ex in layered] != [ex.tokens.numel() for ex in data.examples]:
            raise ValueError(f"{data.directory}: its layers' features are of other sequences than its examples")
    else:
        features = prefill_features(target, [ex.tokens for ex in data.examples], feature_layers=layers)
    for ex, f in zip(data.examples, features):
        ex.features = f


def training_summary(kind: str, target_name: str, data: TrainingData, train: Sequence[Example],
                     held_out: Sequence[Example], cfg: TrainConfig, history: List[dict], seconds: float,
                     ranks: Ranks, draft_vocab: int, coverage: float, init_from: Optional[str],
                     init_from_target: bool) -> dict:
    """How the head was trained (saved beside it as ``training.json``)."""
    meta, total = data.meta, len(history)
    return dict(kind=kind, target=target_name,
                data=dict(meta["settings"], sequences=meta["sequences"], tokens=meta["tokens"],
                          learned_tokens=meta["learned_tokens"], held_out_sequences=len(held_out),
                          **{k: meta[k] for k in ("shards", "feature_dtype") if k in meta}),
                train=dict(asdict(cfg), total_steps=total, epochs_seen=round(total * cfg.batch_sequences / len(train), 2),
                           tokens_seen=history[-1]["tokens_seen"], seconds=round(seconds, 1),
                           threads=torch.get_num_threads(), processes=ranks.world,
                           products=str(compute_dtype(cfg.compute_dtype, ranks.device)).replace("torch.", "")),
                draft_vocab=dict(size=draft_vocab, coverage=round(coverage, 4)),
                final_eval={k: v for k, v in history[-1].items() if k.startswith("eval_")},
                init_from=init_from, init_from_target=init_from_target,
                eval_history=[{k: v for k, v in r.items() if k in ("step", "tokens_seen") or k.startswith("eval_")}
                              for r in history if any(k.startswith("eval_") for k in r)])
