"""The whole engine through the GPU kernels, without a GPU: ``ops.use_backend("simt32" | "simt64")``
runs every op of speculative_generate on the CUDA kernels of csrc/cuda under the CPU SIMT emulator
(warps of 32 and 64 lanes). Greedy float32 tokens equal the CPU engine's for every method and tree
shape at batch sizes 1 and 3 (at 64 lanes every method on the widest tree, and the static tree), and sampling follows the target distribution (chi-square, with its
negative control). On a machine with a GPU the same kernels run natively in the CUDA tests."""

import threading

import pytest
import torch
import transformers

from jakiro_ext import ops
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models import LlamaModel
from helpers import (DYNAMIC_ONLY, HEAD_METHODS, PROMPTS, SAMPLED, TREES, chi_square_p, copy_head, exact_distribution,
                     power_at_shift, random_head, same, tiny_target, tree_rows_off_their_paths, verified_token_p)

NEW_TOKENS = 16
# The tree shapes of test_generate with a smaller wide tree (the emulator is ~1000x slower than the
# CPU kernels): a dynamic tree whose frontier (8) is wider than its depth, a deep narrow one, a static one.
EMULATED_TREES = {"dynamic-small": TREES["dynamic-small"], "dynamic-wide": TreeConfig(24, 3, 8),
                  "static": TREES["static"]}
CASES = [(k, m, t) for k, m in HEAD_METHODS for t in EMULATED_TREES
         if not (m in DYNAMIC_ONLY and t == "static") and k != "eagle3"] + [(None, "ar", None)]
# At warp width 64 every method (and the EAGLE-3 head) once, on the widest tree (the most rows a
# kernel's lanes share), and the static tree once: the engine code is the same at both widths, and
# every kernel's 64-lane arithmetic is checked against its reference on adversarial shapes (python_tests/gpu).
CASES_64 = [(k, m, "dynamic-wide") for k, m in HEAD_METHODS] + [("eagle2", "eagle2", "static"), (None, "ar", None)]


@pytest.mark.parametrize("backend,kind,method,tree", [("simt32", *case) for case in CASES] +
                         [("simt64", *case) for case in CASES_64])
def test_greedy_tokens_equal_the_cpu_engine(target, backend, kind, method, tree):
    tree = None if tree is None else EMULATED_TREES[tree]
    # The copy head's drafts are accepted (multi-token paths); the random head's, mostly rejected,
    # at one warp width (the emulator's time is what CI has to spend).
    runs = [(None, [PROMPTS[0]]), (None, PROMPTS[:3])] if kind is None else [
        (copy_head(target, kind), [PROMPTS[0]]), (copy_head(target, kind), PROMPTS[:3])]
    if kind is not None and backend == "simt32":
        runs.append((random_head(target, kind), PROMPTS[2:5]))
    for head, prompts in runs:
        # One prompt goes in alone (batch size 1), not as a batch of one.
        run = lambda: speculative_generate(target, head, prompts if len(prompts) > 1 else prompts[0], NEW_TOKENS,
                                           method=method, tree=tree)
        cpu = run()
        with ops.use_backend(backend):
            assert ops.backend() == backend
            gpu = run()
        if len(prompts) == 1:
            cpu, gpu = [cpu], [gpu]
        for g, c in zip(gpu, cpu, strict=True):
            assert same(g, c), (g.token_ids, c.token_ids)
        if kind is not None and head is runs[0][0]:
            assert max(cpu[0].stats.accept_lengths) >= 2  # multi-token paths were exercised
    assert ops.backend() == "native"


def test_replayed_rounds_through_the_simt32_kernels_give_the_eager_tokens(target):
    # A round captured with a CUDA graph's rules (graphs="recorded"; the commit and the draft's
    # catch-up in the capture) on the GPU kernels: what a capture bakes in (a kernel's sizing by
    # the host's lengths) would change the replayed rounds.
    head = copy_head(target, "jakiro")
    kwargs = dict(method="jakiro", tree=EMULATED_TREES["dynamic-small"])
    with ops.use_backend("simt32"):
        eager = speculative_generate(target, head, PROMPTS[:3], 2 * NEW_TOKENS, **kwargs)
        replayed = speculative_generate(target, head, PROMPTS[:3], 2 * NEW_TOKENS, graphs="recorded", **kwargs)
    assert all(same(r, e) for r, e in zip(replayed, eager, strict=True))
    assert max(max(e.stats.accept_lengths) for e in eager) >= 2 and sum(len(e.stats.accept_lengths) for e in eager) > 6


def test_sampling_through_the_simt32_kernels_follows_the_target_distribution():
    """At warp width 32 (the verification kernel's sampling at 64 lanes is checked against the
    reference in test_gpu_head_verify). A sample costs ~85 ms under the emulator, so 600 of them:
    enough to detect a 0.14 shift of a share of the verified token with 95% power (asserted);
    the 0.05 shift is the CPU engine's tests' (test_generate, test_batch), whose engine code is
    this one's; the kernel samples exactly what the reference does, draw for draw
    (test_gpu_head_verify), and that sampler is tested on 40000 draws (test_verify_tree)."""
    vocab = 12
    target = tiny_target(vocab=vocab, embed_std=0.03, seed=3)
    head = copy_head(target, "jakiro", scale=5.0)
    ids = torch.tensor([3, 7, 7, 1, 7, 7])
    temperature, top_p, top_k = 0.8, 0.9, 6
    expected = exact_distribution(target, ids, temperature, top_p, top_k)
    counts, accepted, n, per_call = {}, 0, 600, 300
    assert power_at_shift(tuple(expected.items()), n, shift=0.14) >= 0.95
    with ops.use_backend("simt32"):
        for call in range(n // per_call):  # a batch of 300 copies: each sequence samples with seed + its index
            outs = speculative_generate(target, head, [ids] * per_call, SAMPLED, method="jakiro",
                                        tree=TreeConfig(8, 2, 3), temperature=temperature, top_p=top_p, top_k=top_k,
                                        seed=call * per_call)
            for out in outs:
                key = tuple(out.token_ids)
                counts[key] = counts.get(key, 0) + 1
                accepted += sum(out.stats.accept_lengths)
    assert 0.5 < accepted / n < 2.5, accepted / n
    assert verified_token_p(counts, expected, n) > 1e-3
    assert chi_square_p(counts, expected, n) > 1e-3
    # Negative control: the same samples against the unfiltered distribution are rejected.
    assert chi_square_p(counts, exact_distribution(target, ids, temperature, 1.0, 0), n) < 1e-6


def test_use_backend_simt_nests_is_per_thread_and_checks_its_name(target):
    seen = {}
    with ops.use_backend("simt32"):
        with ops.use_backend("native"):
            seen["inner"] = ops.backend()
        seen["outer"] = ops.backend()
        worker = threading.Thread(target=lambda: seen.update(thread=ops.backend()))
        worker.start()
        worker.join()
    assert seen == {"inner": "native", "outer": "simt32", "thread": "native"}
    assert ops.backend() == "native"
    with pytest.raises(ValueError, match=r"one of \('native', 'simt32', 'simt64'\), got 'cuda'"):
        with ops.use_backend("cuda"):
            pass
    # The emulated kernels take CPU tensors: another device is a clear error, not a wrong result.
    with ops.use_backend("simt64"), pytest.raises((RuntimeError, NotImplementedError), match="jakiro_simt64"):
        ops.linear(torch.ones(2, 4, device="meta"), torch.ones(3, 4, device="meta"))


def test_a_bad_value_met_by_a_simt_kernel_ends_the_round_before_anything_is_emitted(target, monkeypatch):
    # As on a GPU, the emulated ops do not read index values on the host: a kernel that meets a
    # bad one (here a draft token beyond the vocabulary, in the second round's verification)
    # reports it to the device's error word, which the round reads with its accepted tokens.
    verify_tree, calls = ops.verify_tree, []

    def corrupts_second_round(parents, tokens, *args):
        calls.append(1)
        if len(calls) == 3:  # the prefill's, the first round's, then this one
            tokens = tokens.clone()
            tokens[:, -1] = target.config.vocab_size + 5
        return verify_tree(parents, tokens, *args)
    monkeypatch.setattr(ops, "verify_tree", corrupts_second_round)
    seen = []
    with ops.use_backend("simt32"), pytest.raises(RuntimeError, match=r"a draft token id outside the vocabulary"):
        speculative_generate(target, copy_head(target, "eagle2"), PROMPTS[0], NEW_TOKENS, method="eagle2",
                             tree=EMULATED_TREES["dynamic-small"], on_tokens=seen.append)
    assert len(calls) == 3 and len(seen) == 2  # the prefill's token and the first round's, nothing after
    with ops.use_backend("simt32"):
        assert ops.device_errors(torch.zeros(1)).tolist() == [0]  # the round read and cleared the word



NATIVE_CUDA = ["cuda"] if torch.cuda.is_available() and getattr(ops._C, "with_cuda", 0) else []


@pytest.mark.parametrize("backend", ["simt32"] + NATIVE_CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_len", [20, 290])
def test_a_tree_verifies_each_token_bit_for_bit_as_decoding_its_path_on_the_gpu_kernels(backend, dtype, prefix_len):
    """The model's forward through the GPU kernels (the tensor-core linear and attention in
    bf16, emulated): each node of a chain and of a branching tree gets the logits of decoding
    its root path one token at a time, bit for bit, so greedy verification cannot disagree with
    plain decoding even at a near tie. A prefix of 290 puts the tree across the attention's
    256-key split and its rows' tiles before their near runs. On a GPU, natively too."""
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=True, max_position_embeddings=1024)
    model = LlamaModel.from_hf(transformers.LlamaForCausalLM(cfg).float().eval(), dtype=dtype)
    if backend == "cuda":
        assert tree_rows_off_their_paths(model.to("cuda"), prefix_len, T=24) == []
        return
    with ops.use_backend(backend):
        assert tree_rows_off_their_paths(model, prefix_len, T=24) == []
