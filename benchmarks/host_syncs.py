"""How often the decoding loop reads device values on the host, per round: on a GPU each such read
is a device-to-host synchronisation that stalls the launch queue (issue 15 asks for at most one per
round). Counted on the CPU, where nothing stalls, by intercepting every such read
(:mod:`jakiro_ext.engine.host_reads`).

SmolLM2-135M-Instruct with the shipped heads, MT-bench/Spec-Bench prompts, greedy and sampling
(temperature 1, top-p 0.9). Reads in the rounds (draft, verify, commit: ``DecodeBatch.round``) are
counted apart from those of a sequence's start (the checks of its prompt, its prefill). Writes
``results/host_syncs.csv``.
"""
import argparse
import os

import torch
from bench_end_to_end import load_questions
from common import RESULTS, write_csv
from jakiro_ext.engine.host_reads import HostReads, counted_rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    from jakiro_ext.cli.common import chat_ids, load_head
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_hf
    from jakiro_ext.models.llama import LlamaModel
    from jakiro_ext.engine.tree_cost import auto_tree

    hf, tokenizer = load_default_hf(torch.float32)
    target = LlamaModel.from_hf(hf, torch.float32)
    del hf
    prompts = [chat_ids(tokenizer, q["turns"][0]) for q in load_questions(per_category=1)]
    rows = []
    for method in ("ar", "eagle2", "jakiro"):
        head = None if method == "ar" else load_head(method, None, target, DEFAULT_MODEL)
        for size in args.batch_sizes:
            tree = None if head is None else auto_tree(target, head, method, size)
            batch = prompts[:size] if size > 1 else prompts[0]
            for temperature in (0.0, 1.0):
                with HostReads() as reads, counted_rounds(reads) as rounds:
                    speculative_generate(target, head, batch, args.max_new_tokens, method=method, tree=tree,
                                         temperature=temperature, top_p=0.9, eos_token_id=tokenizer.eos_token_id)
                in_rounds = {k: v for (where, k), v in reads.counts.items() if where == "round"}
                rows.append(dict(method=method, batch_size=size, temperature=temperature, rounds=rounds[0],
                                 reads_per_round=round(sum(in_rounds.values()) / rounds[0], 2),
                                 **{f"{k}_per_round": round(v / rounds[0], 2) for k, v in sorted(in_rounds.items())},
                                 reads_per_sequence_start=round(sum(v for (where, _), v in reads.counts.items()
                                                                    if where == "start") / size, 2)))
                print(rows[-1], flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    write_csv(os.path.join(RESULTS, "host_syncs.csv"), rows, fields, restval=0)


if __name__ == "__main__":
    main()
