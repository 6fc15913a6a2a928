"""Draft heads side by side on the same held-out answers: every n-th conversation of a token
corpus (the ``train`` command's held-out rule, so no head here trained on them when it was
trained on that corpus with the same n), the target's features computed for those sequences
alone; or (``--packaged N``) the target's own greedy answers to the first N packaged prompts (the
prompts the engine's benchmarks decode, MT-bench-like, where the training corpus is ShareGPT's).
Per head: held-out acc1..acc4 drafting from its own features as the engine does (Jakiro: also
its contrastive branch), and the acceptance of its rank-0..3 candidates by depth.

    python benchmarks/eval_heads.py --heads old-jakiro=jakiro_ext/heads/SmolLM2-135M-Instruct-jakiro new-jakiro=DIR

Results: ``results/heads_held_out.csv`` (``--tag`` appended)."""
import argparse
import os
import time

import torch

from common import RESULTS, write_csv

from jakiro_ext.cli.common import load_target
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.acceptance import acceptance_profile
from jakiro_ext.training.corpus import read_corpus_meta, read_shard
from jakiro_ext.training.examples import Example
from jakiro_ext.training.features import prefill_features
from jakiro_ext.training.loss import evaluate
from jakiro_ext.training.settings import TrainConfig


def held_out_examples(target, corpus: str, every_nth: int, feature_layers=None):
    sequences = []
    for shard in read_corpus_meta(corpus)["shards"]:
        sequences += [q for q in read_shard(os.path.join(corpus, shard["name"]), shard.get("sha256"))
                      if q.conversation % every_nth == 0]
    features = prefill_features(target, [q.tokens for q in sequences], feature_layers=feature_layers)
    return [Example(q.tokens, f.to(torch.bfloat16), torch.arange(q.tokens.numel()) >= q.prompt_length, q.conversation)
            for q, f in zip(sequences, features)]


def packaged_answers(target, tokenizer, count: int, new_tokens: int) -> list:
    """The first ``count`` packaged prompts (chat template) with the target's greedy answers (up to
    ``new_tokens``, to its end of text): (tokens, the prompt's length) each; the answers are what a
    head is scored on."""
    from jakiro_ext.cli.common import PROMPTS_FILE, chat_ids
    from jakiro_ext.cli.bench import read_prompts
    from jakiro_ext.engine.generate import speculative_generate

    sequences = []
    for row in read_prompts(PROMPTS_FILE, count):
        prompt = chat_ids(tokenizer, row["prompt"], True).flatten()
        out = speculative_generate(target, None, prompt, new_tokens, method="ar", eos_token_id=tokenizer.eos_token_id)
        sequences.append((torch.cat([prompt, torch.tensor(out.token_ids)]), prompt.numel()))
    return sequences


def packaged_examples(target, sequences: list, feature_layers=None):
    """:func:`packaged_answers`' sequences as examples, the target's features computed for them."""
    features = prefill_features(target, [tokens for tokens, _ in sequences], feature_layers=feature_layers)
    return [Example(tokens, f.to(torch.bfloat16), torch.arange(tokens.numel()) >= n, i)
            for i, ((tokens, n), f) in enumerate(zip(sequences, features))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=DIRECTORY of each head")
    ap.add_argument("--data", default="corpus/SmolLM2-135M-Instruct")
    ap.add_argument("--eval-every-nth", type=int, default=50)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--packaged", type=int, metavar="N",
                    help="score on the target's greedy answers to the first N packaged prompts instead")
    ap.add_argument("--packaged-tokens", type=int, default=128, help="new tokens of each packaged answer")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer, _ = load_target("float32")
    t0 = time.perf_counter()

    answers = packaged_answers(target, tokenizer, args.packaged, args.packaged_tokens) if args.packaged else None

    def examples_for(feature_layers=None):  # (a fused head's: the same sequences, its layers' features)
        if answers is not None:
            return packaged_examples(target, answers, feature_layers)
        return held_out_examples(target, args.data, args.eval_every_nth, feature_layers)
    examples = examples_for()
    learned = sum(int(ex.loss_mask.sum()) for ex in examples)
    what = "packaged prompts' answers" if args.packaged else "held-out sequences"
    print(f"{len(examples)} {what} ({learned} learned tokens), features in {time.perf_counter() - t0:.0f} s",
          flush=True)
    rows = []
    for spec in args.heads:
        name, path = spec.split("=", 1)
        head = DraftHead.load(path, target)
        layers = getattr(head, "feature_layers", None)  # (a head on EAGLE-3's features reads those layers)
        mine = examples_for(layers) if layers else examples
        accs = evaluate(head, mine, TrainConfig())
        profile = acceptance_profile(head, mine, depth=4, ranks=4)
        row = dict(head=name, path=path, kind=head.config.kind, sequences=len(examples), learned_tokens=learned,
                   **{k: round(v, 4) for k, v in accs.items()},
                   **{f"p_d{d + 1}_r{r}": round(p, 4) for d, ranks in enumerate(profile["depth_rank"])
                      for r, p in enumerate(ranks)})
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in accs.items()), flush=True)
    stem = "heads_packaged" if args.packaged else "heads_held_out"
    write_csv(os.path.join(RESULTS, f"{stem}{args.tag}.csv"), rows)  # (Jakiro adds contrastive columns)


if __name__ == "__main__":
    main()
