"""vLLM serving a Jakiro head through this package's plugin, end to end, on vLLM's CPU build: a
tiny random Llama target (SmolLM2's tokenizer and vocabulary, 2 layers of width 128, head_dim 64 as vLLM's CPU attention needs) and a random
Jakiro head for it (8 experts, a reduced draft vocabulary), exported with
``head.save(dir, format="serving")``; greedy output with speculation must equal greedy output
without it, and the draft's acceptance is reported. Run in an environment holding vLLM and this
package (``scripts/serving/vllm_check.sh`` makes one):

    python scripts/serving/vllm_check.py --tokenizer DIR [--work DIR] [--shipped DIR]

DIR: a directory with SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json). Exit 0
only when the outputs match; prints vLLM's speculative-decoding metrics."""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

import jakiro_ext
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.llama import LlamaModel

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "1, 2, 3, 4, 5,", "The quick brown fox"]


def make_target(tokenizer_dir: Path, out: Path) -> transformers.LlamaForCausalLM:
    """A tiny random Llama with SmolLM2's vocabulary, saved with the tokenizer (the LM head tied to
    the embedding, as SmolLM2's)."""
    torch.manual_seed(0)
    vocab = json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("vocab_size", 49152)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                                   max_position_embeddings=2048, rms_norm_eps=1e-5, torch_dtype="float32")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a peaked embedding: the model repeats itself, so a head can get drafts accepted
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return model


def make_head(model: transformers.LlamaForCausalLM, out: Path) -> DraftHead:
    """A Jakiro head (8 experts of width 16, a 4,096-token draft vocabulary) that drafts its input
    token again (``fc`` passes the embedding through), saved in the serving format."""
    target = LlamaModel.from_hf(model)
    config = DraftConfig.for_target(target.config, "jakiro", num_experts=8, intermediate_size=16)
    config.draft_vocab_size = 4096
    head = DraftHead(config).init_weights(1, std=0.05)
    H = config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H) * 4.0
        head.set_draft_vocab(torch.arange(config.draft_vocab_size))
    head.bind(target).save(out, format="serving")
    return head


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams, TokensPrompt
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def ours_as_a_chain(model, head, prompts, max_tokens, k):
    """This package's engine drafting the head as vLLM does (a chain of k top-1 tokens from the
    main branch, the LM head in float32): the tokens and the drafted tokens accepted in all."""
    from jakiro_ext.config import TreeConfig
    from jakiro_ext.engine.generate import speculative_generate
    os.environ["JAKIRO_CPU_BF16_DRAFT_LM_HEAD"] = "0"  # (on the CPU the engine's draft reads it in bf16 by default)
    target = LlamaModel.from_hf(model)
    outs = [speculative_generate(target, head.bind(target), torch.tensor(ids), max_tokens, method="eagle2",
                                 tree=TreeConfig(k + 1, k, 1)) for ids in prompts]
    return [o.token_ids for o in outs], sum(sum(o.stats.accept_lengths) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--shipped", type=Path, default=None,
                    help="SmolLM2-135M-Instruct's directory: serve the real target with the shipped Jakiro head, on "
                         "the packaged prompts, instead of the tiny random pair")
    ap.add_argument("--prompts", type=int, default=8, help="packaged prompts (with --shipped)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm_check_"))
    target_dir, head_dir = work / "target", work / "head"
    if args.shipped:
        target_dir = args.shipped
        model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        head = DraftHead.load(Path(jakiro_ext.__file__).parent / "heads" / "SmolLM2-135M-Instruct-jakiro").float()
        head.save(head_dir, format="serving")
        tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
        lines = (Path(jakiro_ext.__file__).parent / "data" / "prompts.jsonl").read_text().splitlines()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["prompt"]}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                   for line in lines[:args.prompts]]
    else:
        model = make_target(args.tokenizer, target_dir)
        head = make_head(model, head_dir)
        tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
    print("target", target_dir, "head", head_dir, json.loads((head_dir / "config.json").read_text())["architectures"])

    from vllm import LLM
    # The KV cache's size given in bytes: on the CPU backend the default (a fraction of the machine's
    # memory, less the worker's resident size) comes to nothing once the target and the head are loaded
    # on a small machine. 256 MiB holds 512 positions of either target many times over.
    common = dict(model=str(target_dir), dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                  kv_cache_memory_bytes=256 << 20)
    plain_llm = LLM(**common)
    plain = generate(plain_llm, prompts, args.max_tokens)
    del plain_llm
    spec_llm = LLM(**common, disable_log_stats=False,
                   speculative_config={"method": "eagle", "model": str(head_dir.resolve()),
                                       "num_speculative_tokens": args.k})
    spec = generate(spec_llm, prompts, args.max_tokens)
    metrics = {m.name: getattr(m, "value", None) for m in spec_llm.get_metrics() if "spec_decode" in m.name}
    print("vLLM's speculative decoding counters:", metrics)
    ours, accepted = ours_as_a_chain(model, head, prompts, args.max_tokens, args.k)
    vllm_accepted = metrics.get("vllm:spec_decode_num_accepted_tokens")
    print(f"drafted tokens accepted: vLLM {vllm_accepted}, this package's engine drafting the same chain {accepted}")
    same = [a == b for a, b in zip(plain, spec)]
    print(f"greedy tokens equal with and without the Jakiro head: {sum(same)}/{len(same)}; "
          f"equal to this package's engine's: {sum(a == b for a, b in zip(plain, ours))}/{len(ours)}")
    for i, ok in enumerate(same):
        if not ok:
            first = next(j for j, (a, b) in enumerate(zip(plain[i], spec[i])) if a != b)
            print(f"  prompt {i}: first difference at token {first}: {plain[i][first]} vs {spec[i][first]}")
    return 0 if all(same) and accepted > 0 and vllm_accepted == accepted else 1


if __name__ == "__main__":
    sys.exit(main())
