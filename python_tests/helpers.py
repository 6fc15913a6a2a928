"""Helpers the engine, model and training tests share: tiny random targets, heads that get
drafts accepted, the trees and method pairs every engine test runs, and the sampling statistics
(exact distributions by enumeration, chi-square with pooling, power against a shift, a lossy
verifier for negative controls, the integral transform of sampled runs), EAGLE-3 checkpoints with
their layer in plain PyTorch, and a tiny Llama saved for the peers' own loops."""

import copy
import functools
import json

import numpy as np
import scipy.stats
import torch
import transformers
from safetensors.torch import save_file

from conftest import gen
from jakiro_ext.ops import reference
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.candidate import Candidate
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models import LlamaModel
from jakiro_ext.models.default import default_model_dir
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.eagle3 import Eagle3Config, Eagle3Head
from jakiro_ext.training import eagle3
from jakiro_ext.training.examples import collate, make_example
from jakiro_ext.training.loss import batch_loss, evaluate

TREES = {"dynamic-small": TreeConfig(16, 4, 4), "dynamic-60-5-10": TreeConfig(60, 5, 10),
         "static": TreeConfig(choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]])}
HEAD_METHODS = [("eagle2", "eagle2"), ("jakiro", "eagle2"), ("jakiro", "jakiro"), ("jakiro", "jakiro_star"),
                ("gumiho", "eagle2"), ("gumiho", "gumiho"), ("jakiro_gumiho", "gumiho"),
                ("eagle3", "eagle2")]  # (an EAGLE-3 head drafts as a dense head, on three of the target's layers)
DYNAMIC_ONLY = ("jakiro", "gumiho")  # methods refused on a static tree (tested below)


def tiny_target(vocab: int = 211, embed_std: float = 0.02, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                   rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.model.embed_tokens.weight.data.normal_(0, embed_std, generator=gen(seed + 1))
    return LlamaModel.from_hf(hf)


def random_head(target, kind, seed=1, std=0.2):
    if kind == "eagle3":
        return _eagle3_head(target, seed, std).bind(target)
    config = DraftConfig.for_target(target.config, kind, num_experts=4)
    return DraftHead(config).init_weights(seed, std=std).bind(target)


# An acceptance profile for a Jakiro head (what the tree choice reads): the live choice's tests.
JAKIRO_PROFILE = {"depth_rank": [[0.6, 0.2], [0.5, 0.2], [0.4, 0.2]],
                  "contrastive_depth_rank": [[0.3, 0.2], [0.3, 0.2], [0.3, 0.2]]}


def profiled_head(target):
    """A Jakiro copy head (:func:`copy_head`) with :data:`JAKIRO_PROFILE`: its tree is chosen live."""
    head = copy_head(target, "jakiro")
    head.acceptance = copy.deepcopy(JAKIRO_PROFILE)
    return head


def copy_head(target, kind, scale=300.0):
    """A head whose feature is scale * embed(its input token): with tied embeddings it proposes
    the token it was given, which tiny random models tend to repeat, so drafts get accepted. A
    Gumiho head's later layers run the same: its serial layers add nothing, and its MLP heads
    give SiLU of their leaf's ``fc`` output, close to it where the embedding is positive. An
    EAGLE-3 head: :func:`eagle3_copy_head`."""
    if kind == "eagle3":
        return eagle3_copy_head(target, scale)
    head = random_head(target, kind)
    H = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H) * scale
        for layer in [head, *(head.layers if head.config.num_layers > 1 else ())]:
            layer.o_proj.weight.zero_()
            (layer.w_down if head.config.num_experts else layer.down_proj.weight).zero_()
        if head.config.num_mlp_heads:
            head.mlp_in_weight.zero_()
            head.mlp_in_weight[:, :, H:] = torch.eye(H)
            head.mlp_block_weight.zero_()
    return head


def prompt(n=13, vocab=211, seed=2):
    return torch.randint(0, vocab, (n,), generator=gen(seed))


def sharp_target() -> LlamaModel:
    """The tiny target with sharper attention: its logits depend on the tokens' positions (the
    plain tiny target's hardly do: shifting a tree's positions by one changes almost no argmax),
    so an engine that gets a position wrong gives other tokens."""
    model = tiny_target()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.weight.mul_(6)
    return model


SAMPLED = 3  # tokens per generation: the prompt's bonus, then a round's depth-1 and depth-2 tokens
# (kind, method, tokens per generation, tree): gumiho's first MLP layer is depth 3 (after a
# serial step), so its generations run a token longer to reach it.
SAMPLING_CASES = [("eagle2", "eagle2", SAMPLED, TreeConfig(8, 2, 3)), ("jakiro", "jakiro", SAMPLED, TreeConfig(8, 2, 3)),
                  ("jakiro", "jakiro_star", SAMPLED, TreeConfig(8, 2, 3)),
                  ("gumiho", "gumiho", SAMPLED + 1, TreeConfig(24, 3, 3))]


def exact_distribution(target, ids, temperature, top_p, top_k, tokens=SAMPLED):
    """P(t1, .., t_tokens) of the target's filtered distribution, by enumeration: {tuple: prob}."""
    probs = {(): 1.0}
    for _ in range(tokens):
        nxt = {}
        for prefix, p in probs.items():
            if p < 1e-12:
                continue
            seq = torch.cat([ids, torch.tensor(prefix, dtype=torch.int64)]).unsqueeze(0)
            cache = target.new_cache(1, seq.shape[1])
            logits, _ = target(seq, cache, last_logits_only=True)
            dist = reference.filtered_distribution(logits[0, -1], temperature, top_p, top_k)
            dist = dist / dist.sum()  # top-p leaves the kept mass unnormalised
            for t in torch.nonzero(dist > 0).flatten().tolist():
                nxt[prefix + (t,)] = p * float(dist[t])
        probs = nxt
    return probs


def chi_square_p(counts, expected_probs, n):
    """p-value of observed counts against expected probabilities (bins with an expected count
    below 5 pooled; an outcome of probability 0 that was observed makes p = 0)."""
    if any(k not in expected_probs for k in counts):
        return 0.0
    stat, bins, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for k, p in expected_probs.items():
        e, o = n * p, counts.get(k, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat += (o - e) ** 2 / e
            bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    return float(scipy.stats.chi2.sf(stat, bins - 1))


def marginal(probs_or_counts: dict, k: int) -> dict:
    """The first ``k`` tokens' distribution (or counts) of a distribution over token tuples."""
    out = {}
    for key, v in probs_or_counts.items():
        out[key[:k]] = out.get(key[:k], 0) + v
    return out


def _rank_pooled(counts: dict, pair_probs: dict):
    """Counts and probabilities of the second token's rank under p(. | first token), all first
    tokens pooled: a share that moves the same way in every context adds up in one bin."""
    by_context = {}
    for key, p in pair_probs.items():
        by_context.setdefault(key[:1], []).append((p, key))
    rank = {key: r for group in by_context.values() for r, (_, key) in enumerate(sorted(group, reverse=True))}
    pooled_counts, pooled_probs = {}, {}
    for key, c in counts.items():
        r = (rank.get(key, -1),)  # an impossible pair: a bin of probability 0, so p = 0
        pooled_counts[r] = pooled_counts.get(r, 0) + c
    for key, p in pair_probs.items():
        pooled_probs[(rank[key],)] = pooled_probs.get((rank[key],), 0) + p
    return pooled_counts, pooled_probs


def verified_token_p(counts: dict, expected: dict, n: int) -> float:
    """p-value for the first token the verification emits (a generation's second: the first is
    the prefill's own sample): chi-square over (first, second) pairs and over the second token's
    rank in its context, Bonferroni-combined."""
    pairs, observed = marginal(expected, 2), marginal(counts, 2)
    ranked = _rank_pooled(observed, pairs)
    return min(1.0, 2 * min(chi_square_p(observed, pairs, n), chi_square_p(*ranked, n)))


def shifted(expected: dict, rank: int, shift: float) -> dict:
    """(first, second)-pair probabilities with the second token's rank-``rank`` share moved by
    ``shift`` in every context (the other shares rescaled): what a biased verifier would emit."""
    pairs, out = marginal(expected, 2), {}
    for context, pc in marginal(expected, 1).items():
        cond = sorted(((pairs[k] / pc, k) for k in pairs if k[:1] == context), reverse=True)
        s0, k0 = cond[min(rank, len(cond) - 1)]
        s1 = min(max(s0 + shift, 0.0), 1.0)
        for s, k in cond:
            out[k] = pc * (s1 if k == k0 else (s * (1 - s1) / (1 - s0) if s0 < 1 else 0.0))
    return out


@functools.lru_cache(maxsize=None)
def power_at_shift(expected_items: tuple, n: int, shift: float = 0.05, alpha: float = 1e-3, sims: int = 200) -> float:
    """The smallest probability, over the verified token's three largest shares moved up or down
    by ``shift``, that :func:`verified_token_p` falls below ``alpha`` on ``n`` samples (by
    simulation): the power the test has against such a bias."""
    expected = dict(expected_items)
    rng = np.random.default_rng(0)
    worst = 1.0
    for rank in range(3):
        for sign in (1, -1):
            q = shifted(expected, rank, sign * shift)
            keys = list(q)
            probs = np.array([q[k] for k in keys])
            hits = 0
            for _ in range(sims):
                draw = rng.multinomial(n, probs / probs.sum())
                hits += verified_token_p({k: int(c) for k, c in zip(keys, draw) if c}, expected, n) < alpha
            worst = min(worst, hits / sims)
    return worst


def lossy_verifier(monkeypatch, scale: float = 0.7):
    """Patch the engine's verification to accept a drafted token with probability
    min(1, p / (scale q)) instead of p / q (draws scaled): a lossy sampler, for negative controls."""
    from jakiro_ext import ops

    exact = ops.verify_tree

    def lossy(parents, tokens, logits, uniforms=None, *args):
        if uniforms is not None:
            uniforms = torch.cat([uniforms[:, :-1] * scale, uniforms[:, -1:]], 1)
        return exact(parents, tokens, logits, uniforms, *args)

    monkeypatch.setattr(ops, "verify_tree", lossy)


# The sampling tests' size: 4000 samples detect a 0.05 shift of a share of the verified token
# with >= 95% power (asserted by power_at_shift in each test).
SAMPLES = 4000


def tree_rows_off_their_paths(model, prefix_len: int, T: int) -> list:
    """The (tree, node) pairs whose verification logits, in a tree of T tokens after a random
    prefix of prefix_len, are not bit for bit those of decoding the node's root path one token at
    a time after the same prefix: for a chain, and for a random branching tree (siblings between a
    node's ancestors). Empty when greedy verification cannot disagree with plain decoding."""
    from jakiro_ext import ops
    from conftest import random_parents

    vocab, device = model.config.vocab_size, model.lm_head.weight.device
    prefix = torch.randint(0, vocab, (1, prefix_len), generator=gen(4)).to(device)
    tokens = torch.randint(0, vocab, (1, T), generator=gen(6)).to(device)

    prefilled = model.new_cache(batch=1, capacity=prefix_len + T + 1)
    model(prefix, prefilled)
    prefilled.commit(prefix_len)
    after_prefix = lambda: copy.deepcopy(prefilled)  # noqa: E731 (the prefill once: it dominates under the emulator)

    off = []
    trees = {"chain": torch.arange(-1, T - 1).unsqueeze(0), "branching": random_parents(1, T, seed=5, max_children=3)}
    for name, parents in trees.items():
        depth = torch.zeros(1, T, dtype=torch.int64)
        for i in range(1, T):
            depth[0, i] = depth[0, parents[0, i]] + 1
        tree, _ = model(tokens, after_prefix(), ops.build_tree_mask(parents).to(device), depth.to(device))
        for node in range(T):
            path = [node]
            while parents[0, path[0]] >= 0:
                path.insert(0, int(parents[0, path[0]]))
            cache = after_prefix()
            for i in path:
                logits, _ = model(tokens[:, i:i + 1], cache)
                cache.commit(1)
            if not torch.equal(tree[0, node], logits[0, 0]):
                off.append((name, node))
    return off


# ----------------------------------------------------------------------------- shared cases
# Prompts of several lengths (1 to 20 tokens) that the batch tests decode together.
PROMPTS = [prompt(n, seed=s) for n, s in [(13, 2), (5, 3), (20, 4), (1, 5), (9, 6)]]


def integral_transform(hf, ids, runs, temperature: float, top_k: int = 0) -> torch.Tensor:
    """The randomised probability integral transform of every token of ``runs`` (lists of tokens
    after ``ids`` [1, P]) under ``hf``'s distribution given its prefix (temperature, top-k), in
    token order: F(x) - V p(x), V uniform. Uniform on [0, 1) exactly when every token has the
    target's distribution given what came before it (the values are then independent too)."""
    values, draws = [], torch.Generator().manual_seed(9)
    with torch.no_grad():
        for tokens in runs:
            logits = hf(torch.cat([ids[0], torch.tensor(tokens)])[None]).logits[0, ids.shape[1] - 1:-1]
            p = torch.stack([reference.filtered_distribution(row, temperature, 1.0, top_k) for row in logits])
            x = torch.tensor(tokens)[:, None]
            px = p.gather(1, x)[:, 0]
            values.append(p.cumsum(-1).gather(1, x)[:, 0] - px * torch.rand(len(tokens), generator=draws, dtype=p.dtype))
    return torch.cat(values)


def tiny_llama_dir(path, sharpness: float = 1.0) -> transformers.LlamaForCausalLM:
    """A tiny GQA transformers Llama (vocabulary 211, rope_theta 1e5, tied embeddings, its final
    norm scaled by ``sharpness``, which sharpens its distributions; its argmax mostly repeats the
    input token) saved in ``path`` with SmolLM2's tokenizer; returned in eval mode."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True, rope_theta=100000.0, eos_token_id=0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_(0, 0.02)
        hf.model.norm.weight.mul_(sharpness)
    hf.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return hf


def same(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.stats.accept_lengths == b.stats.accept_lengths
            and a.stats.stop_reason == b.stats.stop_reason and a.stats.target_forwards == b.stats.target_forwards)


# The live chooser's test trees: BIG best by the cost model, SMALL close behind, FAR far behind.
BIG, SMALL, FAR = TreeConfig(16, 3, 4), TreeConfig(4, 2, 2), TreeConfig(32, 5, 4)


def candidates():
    # The cost model's view: BIG best, SMALL close behind, FAR far behind, plain decoding last.
    return [Candidate(BIG, 2.5, 0.020), Candidate(SMALL, 1.9, 0.017), Candidate(FAR, 2.6, 0.060),
            Candidate(None, 1.0, 0.012)]


def run(chooser, rounds, seconds_of=lambda c: c.expected_seconds, tokens_of=lambda c: c.expected_tokens, rows=1,
        catch_up=0.0):
    """Drive the chooser with a live machine given as functions of the candidate (``catch_up``: the
    seconds of the draft's catch-up before a tree that follows plain decoding); returns the trees run."""
    ran = []
    for _ in range(rounds):
        c = chooser.choose(rows)
        caught_up = catch_up if c.tree is not None and ran and ran[-1] is None else 0.0
        chooser.record(c, rows, seconds_of(c), tokens_of(c), caught_up)
        ran.append(c.tree)
    return ran


def make_examples(target, count=6):
    out = []
    for k in range(count):
        x = prompt(6, seed=40 + k)
        answer = speculative_generate(target, None, x, 30).token_ids
        toks = torch.cat([x, torch.tensor(answer)])
        out.append(make_example(target, toks, torch.arange(toks.numel()) >= 6))
    return out


# ----------------------------------------------------------------------------- EAGLE-3
def _eagle3_head(target, seed=1, std=0.2):
    """A random EAGLE-3 head (unbound) on the streams entering the tiny target's layers 0, 1, 2,
    its draft vocabulary the target's."""
    c = target.config
    config = Eagle3Config(hidden_size=c.hidden_size, vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size,
                          num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                          intermediate_size=c.intermediate_size, feature_layers=[0, 1, 2])
    return eagle3.init_weights(Eagle3Head(config), seed=seed, std=std)


def eagle3_copy_head(target, scale=300.0):
    """An EAGLE-3 head that proposes the token before the one it is given, again and again: it
    reads the streams entering the target's layers 0, 1 and 2, and ``fc`` keeps scale * the
    first, the embedding of the committed token whose features they are (the token before the
    row's input); its attention and MLP add nothing (``o_proj`` and ``down_proj`` zero), so a
    drafted row's feature is its parent's. Runs of a repeated token, which tiny random models
    tend to produce, get accepted. Its draft vocabulary is the target's, reversed (``d2t`` not
    the identity): its LM head is the tied embedding's rows in that order."""
    head, V, H = _eagle3_head(target), target.config.vocab_size, target.config.hidden_size
    order = torch.arange(V - 1, -1, -1)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H) * scale
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
        head.lm_head.weight.copy_(target.embed_tokens.weight[order])
        head.draft_to_target.copy_(order)
    return head.bind(target)


def six_layer_target():
    """A transformers Llama deep enough for EAGLE-3's default layers (2, L / 2, L - 3 = 2, 3, 3)."""
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


def write_eagle3(path, vocab=211, H=64, draft_ids=None, layers=None, seed=0, dtype=torch.float16):
    """A checkpoint as EAGLE-3 / SpecForge save it: midlayer.* with q/k/v over 2H, fc [H, 3H] without
    bias, norm, lm_head over the draft vocabulary, d2t (draft id -> offset to the target id) and
    t2d (target id -> in the draft vocabulary), a LlamaForCausalLMEagle3 config."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.arange(0, vocab, 3) if draft_ids is None else draft_ids
    Vd, heads, kv, hd, inner = draft_ids.numel(), 4, 2, 16, 96

    def w(*shape, std=0.2):
        return (torch.randn(shape, generator=g) * std).to(dtype)
    state = {"fc.weight": w(H, 3 * H, std=0.05), "norm.weight": 1 + w(H, std=0.1), "lm_head.weight": w(Vd, H),
             "midlayer.hidden_norm.weight": 1 + w(H, std=0.1), "midlayer.input_layernorm.weight": 1 + w(H, std=0.1),
             "midlayer.post_attention_layernorm.weight": 1 + w(H, std=0.1),
             "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * H), "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * H),
             "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, heads * hd),
             "midlayer.mlp.gate_proj.weight": w(inner, H), "midlayer.mlp.up_proj.weight": w(inner, H),
             "midlayer.mlp.down_proj.weight": w(H, inner),
             "d2t": draft_ids - torch.arange(Vd), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, draft_ids[draft_ids < vocab], True)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": H, "intermediate_size": inner, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab,
              "draft_vocab_size": Vd, "max_position_embeddings": 2048, "torch_dtype": "float16"}
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def eagle3_reference(state, embed, tokens, aux, eps=1e-6, theta=10000.0, heads=4, kv=2, hd=16, own=None):
    """EAGLE-3's layer in plain PyTorch over a whole sequence (causal), from the checkpoint's own
    names: (the output fed to the next step, the logits over the draft vocabulary). ``own``: the
    head's own outputs [k, H] fed to the last k rows (drafted rows), after the target's layers."""
    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    T = tokens.numel()
    h = aux @ state["fc.weight"].T
    if own is not None:
        h = torch.cat([h, own])
    x = torch.cat([rms(embed[tokens], state["midlayer.input_layernorm.weight"]),
                   rms(h, state["midlayer.hidden_norm.weight"])], -1)
    q = (x @ state["midlayer.self_attn.q_proj.weight"].T).view(T, heads, hd)
    k = (x @ state["midlayer.self_attn.k_proj.weight"].T).view(T, kv, hd)
    v = (x @ state["midlayer.self_attn.v_proj.weight"].T).view(T, kv, hd)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k).repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v.repeat_interleave(heads // kv, 1)).reshape(T, -1)
    u = h + attn @ state["midlayer.self_attn.o_proj.weight"].T
    n = rms(u, state["midlayer.post_attention_layernorm.weight"])
    gate, up = n @ state["midlayer.mlp.gate_proj.weight"].T, n @ state["midlayer.mlp.up_proj.weight"].T
    out = u + (torch.nn.functional.silu(gate) * up) @ state["midlayer.mlp.down_proj.weight"].T
    return out, rms(out, state["norm.weight"]) @ state["lm_head.weight"].T


def train_briefly(head, examples, cfg, steps=40, lr=3e-3):
    """(held-out-style evaluation before, the losses, the evaluation after) of ``steps`` AdamW
    steps on the examples as one batch: a short run that shows whether a head learns."""
    before = evaluate(head, examples, cfg, steps=2)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    batch = collate(examples, 64)
    losses = []
    for _ in range(steps):
        loss, _ = batch_loss(head, batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return before, losses, evaluate(head, examples, cfg, steps=2)
