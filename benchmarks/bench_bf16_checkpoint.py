"""A bf16 checkpoint decoded in float32 on the CPU: the engine reading bf16 copies of its weights
(widened exactly in registers: the same bits) against reading the float32 parameters
(``JAKIRO_CPU_BF16_WEIGHTS=0``), alternated in one process.

The target is the default model (SmolLM2-135M-Instruct) with every weight rounded to bf16, as a
bf16 checkpoint loaded in float32 has them (the default model itself comes from a Q4_1 GGUF: its
float32 weights are not bf16 values, and it reads the parameters). Measured: forwards of 1, 2, 4
and 8 tokens behind 256 (a decoding step, trees), and generation on the packaged prompts (64 new
tokens each, greedy): plain decoding and Jakiro with the shipped head on the cost model's fixed
tree, each both ways, the arms alternated prompt by prompt; every pair of outputs is checked
equal. Writes ``results/bf16_checkpoint.csv``."""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from common import RESULTS, machine, memory_bandwidth_gbs, write_csv

PREFIX = 256
TREE_SIZES = (1, 2, 4, 8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="alternations of each forward")
    ap.add_argument("--prompts", type=int, default=8, help="packaged prompts generated from")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bf16_checkpoint.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from jakiro_ext import ops
    from jakiro_ext.cli.common import HEADS_DIR, chat_ids, load_head
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.engine.tree_cost import auto_tree
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_target

    target, tokenizer = load_default_target(torch.float32)
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.bfloat16().float())
    ways = {"bf16 copies": "1", "float32 parameters": "0"}

    def way(name):
        os.environ["JAKIRO_CPU_BF16_WEIGHTS"] = ways[name]

    way("bf16 copies")
    t = time.perf_counter()
    assert target.streamed_weights() is not None
    made_s = time.perf_counter() - t
    bandwidth = memory_bandwidth_gbs(args.threads)
    rows = []
    common = dict(machine=machine(), threads=args.threads, read_gbs=round(bandwidth, 1), copies_made_s=round(made_s, 3))

    cache = target.new_cache(1, PREFIX + max(TREE_SIZES))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        target(torch.randint(0, target.config.vocab_size, (1, PREFIX), generator=g), cache, last_logits_only=True)
        cache.commit(PREFIX)
        times = {}
        for _ in range(args.rounds):
            for T in TREE_SIZES:
                tokens = torch.randint(0, target.config.vocab_size, (1, T), generator=g)
                parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, T)]])
                depths = torch.zeros(1, T, dtype=torch.int64)
                for i in range(1, T):
                    depths[0, i] = depths[0, parents[0, i]] + 1
                mask = ops.build_tree_mask(parents)
                outs = []
                for name in ways:
                    way(name)
                    target(tokens, cache, mask, depths)
                    t = time.perf_counter()
                    for _ in range(3):
                        out = target(tokens, cache, mask, depths)
                    times.setdefault((T, name), []).append((time.perf_counter() - t) / 3 * 1e3)
                    outs.append(out[0])
                assert torch.equal(outs[0], outs[1]), f"{T} tokens: the two ways disagree"
    for T in TREE_SIZES:
        copies, params = (statistics.median(times[(T, name)]) for name in ways)
        rows.append(dict(common, measure="forward", tokens=T, copies_ms=round(copies, 3), parameters_ms=round(params, 3),
                         speedup=round(params / copies, 3)))
        print(f"forward of {T} token(s): {copies:.2f} ms with bf16 copies, {params:.2f} ms with the float32 "
              f"parameters ({params / copies:.2f}x)", flush=True)

    head = load_head("jakiro", None, target, DEFAULT_MODEL.split("/")[-1])
    way("float32 parameters")  # both ways run the tree the float32 parameters' cached costs choose
    tree = auto_tree(target, head, "jakiro")
    prompts = [chat_ids(tokenizer, json.loads(line)["prompt"], True).flatten()
               for line in (Path(HEADS_DIR).parent / "data" / "prompts.jsonl").read_text().splitlines()
               if line.strip()][:args.prompts]
    wall, tokens = {}, {}
    arms = [(method, name) for method in ("ar", "jakiro") for name in ways]
    for i, prompt in enumerate(prompts):
        outs = {}
        for method, name in arms[i % len(arms):] + arms[:i % len(arms)]:
            way(name)
            o = speculative_generate(target, None if method == "ar" else head, prompt, 64, method=method,
                                     tree=None if method == "ar" else tree)
            outs[method, name] = o.token_ids
            wall[method, name] = wall.get((method, name), 0.0) + o.stats.wall_time_s
            tokens[method, name] = tokens.get((method, name), 0) + o.stats.new_tokens
        assert len({tuple(v) for v in outs.values()}) == 1, f"prompt {i}: the arms' tokens differ"
    for method in ("ar", "jakiro"):
        copies, params = (tokens[method, name] / wall[method, name] for name in ways)
        rows.append(dict(common, measure=f"{method} tokens/s", tokens=64, tree=None if method == "ar" else
                         f"{tree.total_tokens}/{tree.depth}/{tree.top_k}", copies_tokens_per_s=round(copies, 1),
                         parameters_tokens_per_s=round(params, 1), speedup=round(copies / params, 3)))
        print(f"{method}: {copies:.1f} tokens/s with bf16 copies, {params:.1f} with the float32 parameters "
              f"({copies / params:.2f}x)", flush=True)
    os.environ.pop("JAKIRO_CPU_BF16_WEIGHTS", None)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
