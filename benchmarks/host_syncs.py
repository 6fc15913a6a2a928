"""How often the decoding loop reads device values on the host, per round: on a GPU each such read
is a device-to-host synchronisation that stalls the launch queue (issue 15 asks for at most one per
round). Counted on the CPU, where nothing stalls, by intercepting every such read: scalar reads
(``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor: ``aten._local_scalar_dense``), ops
whose output size depends on values (``nonzero``, ``masked_select``, ``unique``, ``equal``), and
``tolist()`` / ``numpy()``.

SmolLM2-135M-Instruct with the shipped heads, greedy, MT-bench/Spec-Bench prompts; the counts
include the prompts' prefill and the first draft (divided over the rounds). Writes
``results/host_syncs.csv``.
"""
import argparse
import collections
import csv
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench_end_to_end import load_questions
from common import RESULTS

aten = torch.ops.aten
VALUE_READS = {aten._local_scalar_dense.default: "scalar", aten.nonzero.default: "nonzero",
               aten.masked_select.default: "masked_select", aten.equal.default: "equal",
               aten._unique2.default: "unique", aten.unique_consecutive.default: "unique"}


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host while active, by kind."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = VALUE_READS.get(func)
        if kind:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy
        for name, original in zip(("tolist", "numpy"), self._saved):
            def counted(tensor, *a, _original=original, _name=name, **k):
                self.counts[_name] += 1
                return _original(tensor, *a, **k)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    from jakiro_ext.cli import chat_ids, load_head
    from jakiro_ext.engine import speculative_generate
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_hf
    from jakiro_ext.models.llama import LlamaModel
    from jakiro_ext.tree_cost import auto_tree

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
            with HostReads() as reads:
                out = speculative_generate(target, head, batch, args.max_new_tokens, method=method, tree=tree,
                                           eos_token_id=tokenizer.eos_token_id)
            outs = out if isinstance(out, list) else [out]
            rounds = max(len(o.stats.accept_lengths) for o in outs) + 1  # + the prefill's forward
            total = sum(reads.counts.values())
            rows.append(dict(method=method, batch_size=size, rounds=rounds, host_reads=total,
                             per_round=round(total / rounds, 1),
                             **{f"{k}_per_round": round(v / rounds, 1) for k, v in sorted(reads.counts.items())}))
            print(rows[-1], flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(os.path.join(RESULTS, "host_syncs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval=0)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
