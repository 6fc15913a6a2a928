"""This package's ops inside Medusa's own decoding loop (medusa-llm 0.1's ``medusa_generate``, run
as it is, with random heads: token equality needs no trained ones): its greedy tokens with our tree
attention, verification, KV commit (and the whole target forward as ``decoder_layers``) equal its
tokens without them and plain greedy decoding's, on a tiny grouped-query Llama and on SmolLM2; with
``verify_tree`` its sampling draws the target's distribution (tested statistically), where Medusa's
own typical acceptance does not (the same test fails it); the patches are undone on exit."""
import json

import pytest
import torch
from scipy.stats import kstest

pytest.importorskip("medusa.model.medusa_model", reason="Medusa's reference code (pip install --no-deps medusa-llm==0.1; "
                                                         "scripts/test.sh installs it)")
import medusa.model.medusa_model as mm  # noqa: E402
import medusa.model.modeling_llama_kv as kv  # noqa: E402

from helpers import integral_transform, tiny_llama_dir  # noqa: E402
from jakiro_ext.engine.generate import speculative_generate  # noqa: E402
from jakiro_ext.integrations import medusa  # noqa: E402
from jakiro_ext.models.default import default_model_dir, load_default_target  # noqa: E402

SWITCHES = [dict(attention=True, verify=False, compact=False), dict(attention=False, verify=True, compact=False),
            dict(attention=False, verify=False, compact=True), dict(), dict(model=True)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    hf = tiny_llama_dir(root / "base")
    return hf, medusa.load_medusa_model(root / "base", seed=1, std=0.5), root


def test_medusas_greedy_loop_with_our_ops_gives_its_tokens_and_plain_greedy_decodings(tiny):
    hf, model, _ = tiny
    all_steps = []
    for seed in (3, 4):
        ids = torch.randint(3, 211, (1, 9), generator=torch.Generator().manual_seed(seed))
        plain = hf.generate(ids, max_new_tokens=80, do_sample=False, eos_token_id=None)[0, 9:].tolist()
        theirs, steps = medusa.generate(model, ids, max_steps=20)
        assert theirs == plain[:len(theirs)]
        all_steps += steps
        for switches in SWITCHES:
            with medusa.use_jakiro_ops(**switches):
                ours = medusa.generate(model, ids, max_steps=20)
            assert ours == (theirs, steps), switches
    assert {0, 1, 2} <= set(all_steps)  # drafts rejected, one accepted, both
    assert kv.LlamaAttention.forward is not medusa._attention and mm.evaluate_posterior is not medusa._evaluate_posterior


def test_the_sampling_path_samples_the_targets_distribution_where_medusas_own_does_not(tmp_path):
    """150 runs of about 30 tokens at temperature 1 from a target sharp enough that drafts are
    accepted and rejected: with ``verify_tree`` every token's integral transform under the target's
    distribution given its prefix is uniform (Kolmogorov-Smirnov); Medusa's own sampling (typical
    acceptance, each tree's root the argmax) fails the same test."""
    hf = tiny_llama_dir(tmp_path / "base", sharpness=6.0)
    model = medusa.load_medusa_model(tmp_path / "base", seed=1)
    ids = torch.randint(3, 211, (1, 6), generator=torch.Generator().manual_seed(5))
    with medusa.use_jakiro_ops(generator=torch.Generator().manual_seed(0)):
        runs = [medusa.generate(model, ids, max_steps=12, temperature=1.0) for _ in range(150)]
    steps = [n for _, accepted in runs for n in accepted]
    assert 0.2 < sum(steps) / len(steps) < 1.8 and 0 in steps and 2 in steps
    ours = integral_transform(hf, ids, [tokens for tokens, _ in runs], 1.0)
    assert kstest(ours.numpy(), "uniform").pvalue > 1e-3 and kstest((0.9 * ours).numpy(), "uniform").pvalue < 1e-6
    torch.manual_seed(0)
    theirs = [medusa.generate(model, ids, max_steps=12, temperature=1.0)[0] for _ in range(150)]
    assert kstest(integral_transform(hf, ids, theirs, 1.0).numpy(), "uniform").pvalue < 1e-6


def test_switches_are_one_at_a_time_and_the_loaders_checks(tiny, tmp_path):
    _, model, root = tiny
    originals = [kv.LlamaModel._prepare_decoder_attention_mask, kv.LlamaAttention.forward, kv.LlamaModel.forward,
                 mm.initialize_medusa, mm.generate_candidates, mm.tree_decoding, mm.evaluate_posterior,
                 mm.update_inference_inputs]
    with pytest.raises(KeyError):
        with medusa.use_jakiro_ops(model=True):
            assert mm.evaluate_posterior is medusa._evaluate_posterior
            raise KeyError("an error inside")
    assert [kv.LlamaModel._prepare_decoder_attention_mask, kv.LlamaAttention.forward, kv.LlamaModel.forward,
            mm.initialize_medusa, mm.generate_candidates, mm.tree_decoding, mm.evaluate_posterior,
            mm.update_inference_inputs] == originals
    with medusa.use_jakiro_ops():
        with pytest.raises(RuntimeError, match="already active"):
            with medusa.use_jakiro_ops():
                pass
    # Medusa's KV buffer sized by KV heads (2 of the 4 attention heads): its own sizes it by attention heads
    model.medusa_generate(torch.tensor([[5, 6, 7]]), max_steps=1).__next__()
    assert model.past_key_values_data.shape == (4, 1, 2, 256, 16)
    with pytest.raises(FileNotFoundError, match="config.json not found: a Medusa heads directory holds"):
        medusa.load_medusa_model(root / "base", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(medusa_num_heads=2, medusa_num_layers=1)))
    torch.save(model.medusa_head.state_dict(), tmp_path / "medusa_lm_head.pt")
    loaded = medusa.load_medusa_model(root / "base", tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.medusa_head.state_dict().values(),
                                                 model.medusa_head.state_dict().values()))


def test_smollm2_in_medusas_loop_with_random_heads():
    """The default model (grouped-query: Medusa's own KV buffer breaks it) as Medusa's KV Llama
    with random heads: Medusa's own loop, with our ops (the whole forward as decoder_layers) and
    without, gives the tokens of this engine's plain decoding."""
    target, tok = load_default_target(torch.float32)
    model = medusa.load_medusa_model(default_model_dir())
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}], add_generation_prompt=True,
                                  return_tensors="pt")["input_ids"]
    plain = speculative_generate(target, None, ids[0], 40).token_ids
    theirs, steps = medusa.generate(model, ids, max_steps=12)
    with medusa.use_jakiro_ops(model=True):
        ours = medusa.generate(model, ids, max_steps=12)
    assert len(theirs) >= 12 and theirs == plain[:len(theirs)] and ours == (theirs, steps)
