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
    "target_forward": ["dtype", "tree_tokens", "prefix", "forward_ms", "relative_to_one_token", "draft_layer_ms"],
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


def main():
    for name, cols in COLUMNS.items():
        path = os.path.join(RESULTS, f"{name}.csv")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rows = list(csv.DictReader(f))
        print(f"\n**{name}** (`benchmarks/results/{name}.csv`)\n")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
