"""Markdown tables of the benchmark CSVs in benchmarks/results (what the README quotes)."""
import csv
import os

from common import RESULTS

COLUMNS = {
    "tree_attention": ["model", "dtype", "tree", "prefix", "ours_ms", "sdpa_ms", "reference_ms", "speedup_vs_sdpa",
                       "kv_gbs", "bandwidth_fraction", "gflops", "max_abs_diff"],
    "moe": ["dtype", "experts", "tokens", "active_experts", "ours_ms", "reference_ms", "speedup_vs_reference",
            "weight_gbs", "max_abs_diff"],
    "contrastive_head": ["dtype", "contrastive", "rows", "ours_ms", "reference_ms", "speedup_vs_reference",
                         "lm_head_gbs", "bandwidth_fraction", "max_abs_diff"],
    "linear": ["dtype", "weight", "rows", "ours_ms", "torch_ms", "speedup_vs_torch", "weight_gbs", "bandwidth_fraction",
               "max_abs_diff"],
    "verify_tree": ["mode", "batch", "accepted", "ours_ms", "reference_ms", "speedup_vs_reference", "max_abs_diff"],
    "compact_kv": ["dtype", "prefix", "moved", "ours_ms", "reference_ms", "eager_gather_ms", "speedup_vs_eager_gather",
                   "max_abs_diff"],
}


def fmt(value: str) -> str:
    try:
        x = float(value)
    except ValueError:
        return value
    if x == int(x) and abs(x) < 1e6 and "." not in value and "e" not in value:
        return value
    return f"{x:.3g}" if abs(x) < 1e-2 or abs(x) >= 1e3 else f"{x:.2f}"


def read_results(name: str):
    """The rows of results/<name>.csv, or None when it has not been written."""
    path = os.path.join(RESULTS, f"{name}.csv")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return list(csv.DictReader(f))


def print_table(cols, rows):
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")


def end_to_end():
    """The end-to-end summary: overall per temperature and method, then per category."""
    rows = read_results("end_to_end_summary")
    if rows is None:
        return
    print("\n**end_to_end** (`benchmarks/results/end_to_end_summary.csv`; overall speedups are means over categories)\n")
    cols = ["temperature", "method", "tree", "tokens_per_s", "tau", "speedup_vs_ar", "speedup_vs_hf_greedy",
            "speedup_vs_hf_prompt_lookup", "all_same_tokens_as_ar"]
    print_table(cols, [r for r in rows if r["category"] == "overall"])
    present = {r["method"] for r in rows}
    methods = [m for m in ("eagle2", "jakiro", "jakiro_star", "gumiho", "jakiro_gumiho") if m in present]
    for t in sorted({r["temperature"] for r in rows}):
        cats = [c for c in dict.fromkeys(r["category"] for r in rows) if c != "overall"] + ["overall"]
        print(f"\nTemperature {t}: speedup vs the engine's AR (tau)\n")
        print("| category | " + " | ".join(methods) + " |")
        print("|" + "---|" * (len(methods) + 1))
        for c in cats:
            cells = []
            for m in methods:
                r = next((r for r in rows if r["temperature"] == t and r["method"] == m and r["category"] == c), None)
                cells.append(f"{fmt(r['speedup_vs_ar'])}x ({fmt(r['tau'])})" if r else "")
            print(f"| {c} | " + " | ".join(cells) + " |")


# target_forward.csv holds several measurements (its "measure" column): one table each.
TARGET_FORWARD = {
    "decoding_step": ["dtype", "ms", "floor_ms", "floor_fraction", "loop_overhead_ms", "bandwidth_gbs"],
    "tree_forward": ["dtype", "tree_tokens", "ms", "relative_to_one_token", "roofline_ms", "roofline_fraction",
                     "bandwidth_gbs"],
    "draft_layer": ["dtype", "tree_tokens", "draft_vocab", "ms", "relative_to_decoding_step"],
    "batched_step": ["dtype", "tree_tokens", "ms", "gflops", "matmul_peak_gflops", "matmul_peak_fraction"],
    "generate_tokens_per_s": ["dtype", "engine_tokens_per_s", "transformers_tokens_per_s", "speedup_vs_transformers"],
}


def target_forward():
    rows = read_results("target_forward")
    for measure, cols in TARGET_FORWARD.items() if rows is not None else ():
        print(f"\n**target_forward: {measure}** (`benchmarks/results/target_forward.csv`)\n")
        print_table(cols, [r for r in rows if r.get("measure") == measure])


def main():
    end_to_end()
    target_forward()
    for name, cols in COLUMNS.items():
        rows = read_results(name)
        if rows is not None:
            print(f"\n**{name}** (`benchmarks/results/{name}.csv`)\n")
            print_table(cols, rows)

if __name__ == "__main__":
    main()
