"""This package's ops inside other projects' loops, timed there (same machine, same run):

* **EAGLE's own loop** (eagle-llm 1.2.1, ``EaModel.eagenerate``: EAGLE-1, its static 26-node tree)
  on SmolLM2-135M-Instruct in float32 with this package's shipped EAGLE-2 head in EAGLE's files,
  greedy, on the first ``--prompts`` packaged prompts: EAGLE's code as it is (made to run on
  transformers 5: :mod:`jakiro_ext.integrations.kv_llama`), with our tree attention,
  verification and KV commit, and with the whole target forward as ``decoder_layers`` too
  (:func:`jakiro_ext.integrations.eagle.use_jakiro_ops`); beside them this engine with the same
  head and EAGLE-1's tree. The arms take turns prompt by prompt (the order rotated); every arm's
  tokens must equal EAGLE's own (and they are plain greedy decoding's). tokens/s: the answer's
  tokens over the call's wall time (the prompt included, as EAGLE's loop has no other clock).
* **Medusa's own loop** (medusa-llm 0.1, ``medusa_generate``: its 50-node Cartesian tree of two
  heads' top-7 x top-6) on the same model and prompts, greedy, the same three arms
  (:func:`jakiro_ext.integrations.medusa.use_jakiro_ops`). No Medusa heads exist for this model:
  random ones (``--medusa-steps`` rounds), whose drafts are almost never accepted, so each round
  gives about one token and the speed is the round's cost with and without our ops, not
  Medusa's speedup.
* **transformers' attention** (``attn_implementation="jakiro_tree"`` against ``"sdpa"``): one
  tree-verification forward of SmolLM2 (16 and 64 nodes, a random tree, its 4D mask) after a
  cached prefix of 128 to 4,096 tokens, the median of ``--reps``.

Writes ``results/peer_loops.csv``."""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from common import RESULTS, machine, write_csv

from jakiro_ext import ops
from jakiro_ext.cli.common import HEADS_DIR
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.integrations import eagle, medusa
from jakiro_ext.integrations import transformers as jt
from jakiro_ext.models.default import default_model_dir, load_default_target
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.ops.reference import unpack_tree_mask
from eagle.model.choices import mc_sim_7b_63


def packaged_prompts(tok, count: int) -> list:
    texts = [json.loads(line)["prompt"] for line in (HEADS_DIR.parent / "data" / "prompts.jsonl").read_text().splitlines()
             if line.strip()][:count]
    return [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                    return_tensors="pt")["input_ids"] for text in texts]


def timed_arms(test: str, target, prompts: list, arms: dict, new_tokens: int) -> list:
    """Each arm (name -> ids -> its tokens after the prompt) on every prompt, the arms taking turns
    (the order rotated prompt by prompt); every arm's tokens checked against plain greedy
    decoding's; rows relative to the first arm."""
    totals = {name: [0, 0.0] for name in arms}
    names = list(arms)
    for i, ids in enumerate(prompts):
        want = speculative_generate(target, None, ids[0], new_tokens).token_ids
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            out = arms[name](ids)
            seconds = time.perf_counter() - t0
            n = min(len(out), new_tokens)
            if out[:n] != want[:n]:
                raise SystemExit(f"{test}, {name}: its tokens differ from plain greedy decoding's on packaged prompt {i}")
            totals[name][0] += n
            totals[name][1] += seconds
        print(f"{test}: prompt {i + 1}/{len(prompts)} done", flush=True)
    base = totals[names[0]][0] / totals[names[0]][1]
    return [dict(test=test, arm=name, prompts=len(prompts), tokens=t[0], tokens_per_s=round(t[0] / t[1], 2),
                 over_their_own=round(t[0] / t[1] / base, 3)) for name, t in totals.items()]


def eagle_loop(prompts: int, new_tokens: int):
    target, tok = load_default_target(torch.float32)
    head = DraftHead.load(HEADS_DIR / "SmolLM2-135M-Instruct-eagle2", target)
    with tempfile.TemporaryDirectory() as tmp:
        eagle.save_for_eagle(head, target.embed_tokens.weight, Path(tmp) / "head")
        model = eagle.load_eagle_model(default_model_dir(), Path(tmp) / "head")
    tree = TreeConfig(choices=[list(c) for c in mc_sim_7b_63])

    def eagles(switches):
        def run(ids):
            with eagle.use_jakiro_ops(**switches):
                return model.eagenerate(ids, max_new_tokens=new_tokens)[0, ids.shape[1]:].tolist()
        return run
    arms = {"EAGLE's own code": eagles(dict(attention=False, verify=False, compact=False)),
            "with tree_attention, verify_tree, compact_kv": eagles(dict()),
            "with decoder_layers too": eagles(dict(model=True)),
            "this engine, same head and tree": lambda ids: speculative_generate(
                target, head, ids[0], new_tokens, method="eagle2", tree=tree).token_ids}
    return timed_arms("EAGLE's eagenerate, greedy", target, packaged_prompts(tok, prompts), arms, new_tokens)


def medusa_loop(prompts: int, steps: int):
    target, tok = load_default_target(torch.float32)
    model = medusa.load_medusa_model(default_model_dir())

    def medusas(switches):
        def run(ids):
            with medusa.use_jakiro_ops(**switches):
                return medusa.generate(model, ids, max_steps=steps)[0]
        return run
    arms = {"Medusa's own code": medusas(dict(attention=False, verify=False, compact=False)),
            "with tree_attention, verify_tree, compact_kv": medusas(dict()),
            "with decoder_layers too": medusas(dict(model=True))}
    return timed_arms("Medusa's medusa_generate, greedy, random heads", target, packaged_prompts(tok, prompts), arms,
                      steps)


def random_tree(nodes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes)]])


def attention_route(prefixes, trees, reps: int):
    jt.register()
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    rows = []
    for prefix in prefixes:
        ids = torch.randint(0, model.config.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(prefix))
        for nodes in trees:
            parents = random_tree(nodes, nodes)
            depths = torch.zeros(nodes, dtype=torch.int64)
            for i in range(1, nodes):
                depths[i] = depths[parents[0, i]] + 1
            sees = unpack_tree_mask(ops.build_tree_mask(parents), nodes)
            mask = torch.cat([torch.ones(1, nodes, prefix, dtype=torch.bool), sees], -1)[:, None]
            tokens = torch.randint(0, model.config.vocab_size, (1, nodes), generator=torch.Generator().manual_seed(1))
            seconds, logits = {}, {}
            for impl in ("sdpa", jt.NAME, "sdpa", jt.NAME):  # (each twice: the first a warm-up)
                model.set_attn_implementation(impl)
                cache = DynamicCache(config=model.config)
                with torch.no_grad():
                    model(ids, cache=cache)
                    times = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        logits[impl] = model(tokens, attention_mask=mask, position_ids=(prefix + depths)[None],
                                             cache=cache).logits
                        times.append(time.perf_counter() - t0)
                        cache.crop(-nodes)
                seconds[impl] = statistics.median(times)
            assert torch.equal(logits["sdpa"].argmax(-1), logits[jt.NAME].argmax(-1))
            rows.append(dict(test="transformers tree step", arm=f"prefix {prefix}, {nodes} nodes",
                             sdpa_ms=round(1e3 * seconds["sdpa"], 2), jakiro_tree_ms=round(1e3 * seconds[jt.NAME], 2),
                             over_sdpa=round(seconds["sdpa"] / seconds[jt.NAME], 3),
                             max_logit_diff=float((logits["sdpa"] - logits[jt.NAME]).abs().max())))
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--medusa-steps", type=int, default=64, help="Medusa's rounds per prompt")
    ap.add_argument("--prefixes", default="128,1024,4096")
    ap.add_argument("--trees", default="16,64")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--parts", default="eagle,medusa,transformers")
    ap.add_argument("--out", default=str(Path(RESULTS) / "peer_loops.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    rows = eagle_loop(args.prompts, args.max_new_tokens) if "eagle" in parts else []
    if "medusa" in parts:
        rows += medusa_loop(args.prompts, args.medusa_steps)
    if "transformers" in parts:
        rows += attention_route([int(n) for n in args.prefixes.split(",")], [int(n) for n in args.trees.split(",")],
                                args.reps)
    for row in rows:
        row.update(machine=machine(), threads=args.threads)
        print(row)
    write_csv(args.out, rows, list(dict.fromkeys(k for r in rows for k in r)))


if __name__ == "__main__":
    main()
