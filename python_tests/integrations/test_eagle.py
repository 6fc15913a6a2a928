"""This package's ops inside EAGLE's own decoding loop (eagle-llm 1.2.1's ``eagenerate``, run as it
is): its greedy tokens with our tree attention, verification, KV commit (and the whole target
forward as ``decoder_layers``) equal its tokens without them and plain greedy decoding's, on a
tiny Llama and on SmolLM2 with this package's EAGLE-2 head; its sampling path samples the
target's distribution (tested statistically, with a control that fails) and at a temperature that
leaves one choice gives the greedy tokens; the patches are undone on exit."""
import json

import pytest
import torch
from scipy.stats import kstest

pytest.importorskip("eagle.model.ea_model", reason="EAGLE's reference code (pip install --no-deps eagle-llm==1.2.1; "
                                                    "scripts/test.sh installs it)")
import eagle.model.ea_model as ea  # noqa: E402
import eagle.model.modeling_llama_kv as kv  # noqa: E402

from jakiro_ext.cli.common import HEADS_DIR  # noqa: E402
from jakiro_ext.engine.generate import speculative_generate  # noqa: E402
from jakiro_ext.integrations import eagle  # noqa: E402
from helpers import integral_transform, tiny_llama_dir  # noqa: E402
from jakiro_ext.models.default import default_model_dir, load_default_target  # noqa: E402
from jakiro_ext.models.heads.config import DraftConfig  # noqa: E402
from jakiro_ext.models.heads.draft_head import DraftHead  # noqa: E402
from jakiro_ext.models.llama import as_target  # noqa: E402

ALL = [dict(), dict(attention=True, verify=False, compact=False), dict(attention=False, verify=True, compact=False),
       dict(attention=False, verify=False, compact=True), dict(model=True)]


def accept_lengths(model, ids, new_tokens, **kw):
    """(EAGLE's tokens after the prompt, its accepted drafts per step)."""
    steps = []
    update = ea.update_inference_inputs

    def counted(*args):
        steps.append(int(args[3]))
        return update(*args)
    ea.update_inference_inputs = counted
    try:
        out = model.eagenerate(ids, max_new_tokens=new_tokens, **kw)
    finally:
        ea.update_inference_inputs = update
    return out[0, ids.shape[1]:].tolist(), steps


def tiny_eagle(root, sharpness: float = 1.0):
    """:func:`helpers.tiny_llama_dir` and an EAGLE-2 head of this package for it that echoes its
    input token (so drafts are accepted): (hf model, EaModel)."""
    hf = tiny_llama_dir(root / "base", sharpness)
    target = as_target(hf)
    head = DraftHead(DraftConfig.for_target(target.config, "eagle2", intermediate_size=128)).init_weights(1).bind(target)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :64] = torch.eye(64) * 300.0
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
    eagle.save_for_eagle(head, target.embed_tokens.weight, root / "head")
    return hf, eagle.load_eagle_model(root / "base", root / "head")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return (*tiny_eagle(root), root)


def test_eagles_greedy_loop_with_our_ops_gives_its_tokens_and_plain_greedy_decodings(tiny):
    hf, model, _ = tiny
    for seed in (3, 4):
        ids = torch.randint(1, 211, (1, 9), generator=torch.Generator().manual_seed(seed))
        plain = hf.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None)[0, 9:].tolist()
        theirs, steps = accept_lengths(model, ids, 40)
        assert sum(steps) > 0 and theirs == plain[:len(theirs)]
        for parts in ALL[1:] + [dict(attention=True, verify=True, compact=True)]:
            with eagle.use_jakiro_ops(**{**dict(attention=False, verify=False, compact=False), **parts}):
                ours, our_steps = accept_lengths(model, ids, 40)
            assert (ours, our_steps) == (theirs, steps), parts
    assert kv.LlamaAttention.forward is not eagle._attention and ea.evaluate_posterior is not eagle._evaluate_posterior


def test_the_sampling_path_at_a_temperature_that_leaves_one_choice_is_greedy(tiny):
    """A temperature of 1e-3 goes through EAGLE's logits processor to ``verify_tree``'s rejection
    sampling (uniforms drawn from the generator given), where the target's scaled distribution
    is all on its argmax: the tokens are the greedy ones."""
    _, model, _ = tiny
    ids = torch.randint(1, 211, (1, 9), generator=torch.Generator().manual_seed(5))
    greedy, _ = accept_lengths(model, ids, 30)
    with eagle.use_jakiro_ops(generator=torch.Generator().manual_seed(0)):
        sampled, steps = accept_lengths(model, ids, 30, temperature=1e-3)
    assert eagle.sampling_settings(ea.prepare_logits_processor(temperature=0.7, top_p=0.9)) == (0.7, 0.9, 0)
    assert eagle.sampling_settings(ea.prepare_logits_processor(temperature=0.7, top_k=5)) == (0.7, 1.0, 5)
    with pytest.raises(NotImplementedError, match="top-p .* before top-k"):
        eagle.sampling_settings(ea.prepare_logits_processor(temperature=0.7, top_p=0.9, top_k=5))
    assert sampled == greedy[:len(sampled)] and sum(steps) > 0


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (1.5, 8)])
def test_the_sampling_path_samples_the_targets_distribution(tmp_path, temperature, top_k):
    """EAGLE's loop sampling with ``verify_tree`` (and its first token from EAGLE's own processor):
    150 runs of 30 tokens from a target sharp enough that drafts (its input token echoed) are
    accepted about half the time. Every token's integral transform under the target's filtered
    distribution given its prefix is uniform (Kolmogorov-Smirnov); the same tokens against the
    target at 1.3x the temperature are not (the control: the test can fail)."""
    hf, model = tiny_eagle(tmp_path, sharpness=6.0)
    ids = torch.randint(1, 211, (1, 6), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)  # (EAGLE's own draws: its first token, its bonus tokens' multinomial)
    with eagle.use_jakiro_ops(generator=torch.Generator().manual_seed(0)):
        runs = [accept_lengths(model, ids, 30, temperature=temperature, top_k=top_k) for _ in range(150)]
    steps = [n for _, accepted in runs for n in accepted]
    assert 0.3 < sum(steps) / len(steps) < 3 and steps.count(0) > len(steps) / 10  # drafts accepted and rejected
    tokens = [t for t, _ in runs]
    assert kstest(integral_transform(hf, ids, tokens, temperature, top_k).numpy(), "uniform").pvalue > 1e-3
    assert kstest(integral_transform(hf, ids, tokens, 1.3 * temperature, top_k).numpy(), "uniform").pvalue < 1e-6


def test_switches_are_one_at_a_time_and_bad_files_are_named(tiny, tmp_path):
    _, model, root = tiny
    originals = [kv.LlamaModel._prepare_decoder_attention_mask, kv.LlamaAttention.forward, kv.LlamaModel.forward,
                 ea.initialize_tree, ea.tree_decoding, ea.evaluate_posterior, ea.update_inference_inputs]
    with pytest.raises(KeyError):
        with eagle.use_jakiro_ops(model=True):
            assert ea.evaluate_posterior is eagle._evaluate_posterior
            raise KeyError("an error inside")
    assert [kv.LlamaModel._prepare_decoder_attention_mask, kv.LlamaAttention.forward, kv.LlamaModel.forward,
            ea.initialize_tree, ea.tree_decoding, ea.evaluate_posterior, ea.update_inference_inputs] == originals
    with eagle.use_jakiro_ops():
        with pytest.raises(RuntimeError, match="already active"):
            with eagle.use_jakiro_ops():
                pass
    with pytest.raises(FileNotFoundError, match="config.json not found: an EAGLE head directory holds"):
        eagle.load_eagle_model(root / "base", tmp_path)
    config = json.loads((root / "head" / "config.json").read_text())
    assert config["bias"] is True and config["rope_theta"] == 100000.0


def test_smollm2_in_eagles_loop_with_the_shipped_eagle2_head(tmp_path):
    """The default model as EAGLE's KV Llama, this package's shipped EAGLE-2 head in EAGLE's files:
    EAGLE's own loop, with our ops and without, gives the tokens of this engine's plain decoding."""
    target, tok = load_default_target(torch.float32)
    head = DraftHead.load(HEADS_DIR / "SmolLM2-135M-Instruct-eagle2")
    eagle.save_for_eagle(head, target.embed_tokens.weight, tmp_path / "head")
    model = eagle.load_eagle_model(default_model_dir(), tmp_path / "head")
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}], add_generation_prompt=True,
                                  return_tensors="pt")["input_ids"]
    plain = speculative_generate(target, None, ids[0], 40).token_ids
    theirs, steps = accept_lengths(model, ids, 24)
    with eagle.use_jakiro_ops(model=True):
        ours, our_steps = accept_lengths(model, ids, 24)
    assert sum(steps) > 0 and theirs == plain[:len(theirs)] and (ours, our_steps) == (theirs, steps)
