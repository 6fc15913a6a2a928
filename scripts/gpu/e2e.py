"""The engine end to end on a device, on random-weight targets of real models' shapes: what a
decoding round costs, eager against replayed graphs, and the tokens/s it would give with the
acceptance the shipped heads reach (measured on the CPU).

For each shape (``smollm2``: SmolLM2-135M's; ``llama3-8b``: Llama-3-8B's), dtype, batch size and
method (``ar``, ``eagle2``, ``jakiro``, ``gumiho``, each head random and shaped for the target),
and each way of launching a round (``eager``; ``cuda`` graphs on a GPU, ``recorded`` replays on
the CPU), one generation: a round's cost is the median time of its rounds after the first two
(the first captures the graph), each round timed from its start to its end (a round ends with
its one read of the device, so the device's work is inside it); the first round, the captures
made, and both again for a second call (with graphs it replays the first call's captures, kept
with the target: no capture, a first round as quick as the others). Also per round: the host's
reads of device values (each a synchronisation on a GPU). Predicted tokens/s: per sequence, (1 + the drafted tokens the shipped
head of that kind is expected to have accepted with the round's tree, from its acceptance
profile) / the round's cost, times the batch; the tree is the one the GPU cost model of
benchmarks/predict_gpu.py chooses for that profile (the shipped profile stands in for the 8B
shape's heads too). Random heads accept almost nothing, so what is timed is a round, not speed.

    python scripts/gpu/e2e.py --device cuda --out e2e.csv
    python scripts/gpu/e2e.py --device cpu --dry-run      (tiny shapes: the script itself, in seconds)
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from common import write_csv  # noqa: E402
from jakiro_ext.engine.batch import ROUND_LISTENERS  # noqa: E402
from jakiro_ext.engine.generate import speculative_generate  # noqa: E402
from jakiro_ext.engine.graph_sessions import free_graphs  # noqa: E402
from jakiro_ext.engine.host_reads import HostReads, counted_rounds  # noqa: E402
from jakiro_ext.engine.tree_cost import choose_tree, expected_accepted  # noqa: E402
from jakiro_ext.models.heads.config import DraftConfig  # noqa: E402
from jakiro_ext.models.heads.draft_head import DraftHead  # noqa: E402
from jakiro_ext.models.llama import LlamaConfig, LlamaModel  # noqa: E402

SHAPES = {
    "smollm2": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=True),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5),
}
HEADS = {"eagle2": dict(kind="eagle2"), "jakiro": dict(kind="jakiro", num_experts=8),
         "gumiho": dict(kind="gumiho", num_layers=2, num_mlp_heads=2, mlp_blocks=2)}


def random_target(shape: str, dtype: torch.dtype, device: str) -> LlamaModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(SHAPES[shape]).to(dtype)
    for name, p in model.named_parameters():
        with torch.no_grad():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.eval()


def random_head(target: LlamaModel, method: str, profile: dict) -> DraftHead:
    config = DraftConfig.for_target(target.config, **HEADS[method])
    config.draft_vocab_size = min(8192, target.config.vocab_size // 2)
    w = target.lm_head.weight
    head = DraftHead(config).init_weights(seed=1).to(w.device, w.dtype)
    head.set_draft_vocab(torch.arange(config.draft_vocab_size, device=w.device))
    head.acceptance = profile
    return head.bind(target)


def shipped_profiles() -> dict:
    """The shipped heads' acceptance profiles (measured on the CPU), by method."""
    import json

    from jakiro_ext.models.default import DEFAULT_MODEL
    heads = os.path.join(ROOT, "jakiro_ext", "heads")
    out = {}
    for method in HEADS:
        path = os.path.join(heads, f"{DEFAULT_MODEL}-{method}", "acceptance.json")
        if os.path.exists(path):
            with open(path) as f:
                out[method] = json.load(f)
    return out


def gpu_tree(target, head, method: str):
    from predict_gpu import gpu_costs
    tree, _ = choose_tree(gpu_costs(target, head, method), head.acceptance, method)
    return tree


def captures_made(target) -> int:
    """The captures the graphed calls' kept sessions made so far (:mod:`jakiro_ext.engine.graph_sessions`)."""
    return sum(s.parts.round.replay.captures for s in target.__dict__.get("_graph_sessions", {}).values()
               if s.parts is not None)


def timed_rounds(target, head, method, tree, prompts, tokens: int, graphs: str, profile_rounds: int = 0):
    """(each round's seconds, host reads in the rounds). With ``profile_rounds``, the CUDA profiler
    (ncu --profile-from-start off) collects that many rounds after the first two, nothing else."""
    starts, seconds = [], []
    profiled = range(2, 2 + profile_rounds)

    def clock(starting: bool) -> None:
        if starting:
            starts.append(time.perf_counter())
            if len(starts) - 1 in profiled:
                torch.cuda.cudart().cudaProfilerStart()
        else:
            seconds.append(time.perf_counter() - starts[-1])
            if len(starts) - 1 in profiled:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
    with HostReads() as reads, counted_rounds(reads):
        ROUND_LISTENERS.append(clock)  # after counted_rounds' listener: the reads are not timed
        try:
            speculative_generate(target, head, prompts, tokens, method=method, tree=tree, graphs=graphs)
        finally:
            ROUND_LISTENERS.remove(clock)
    return seconds, sum(v for (where, _), v in reads.counts.items() if where == "round")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", nargs="+", default=["smollm2", "llama3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--methods", nargs="+", default=["ar", "eagle2", "jakiro", "gumiho"])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens a sequence")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--modes", nargs="+", choices=["eager", "graphs"], default=["eager", "graphs"],
                    help="eager launches, and/or replayed graphs (CUDA graphs on a GPU, recorded on the CPU)")
    ap.add_argument("--profile-rounds", type=int, default=0,
                    help="rounds after the first two that the CUDA profiler collects (ncu --profile-from-start off)")
    ap.add_argument("--dry-run", action="store_true", help="the tiny shape, few tokens (checks the script)")
    ap.add_argument("--out", default="e2e.csv")
    args = ap.parse_args()
    if args.dry_run:
        args.shapes, args.tokens, args.prompt_len = ["tiny"], 8, 8
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA device")
    modes = [m if m == "eager" else "cuda" if args.device == "cuda" else "recorded" for m in args.modes]
    if args.profile_rounds and args.device != "cuda":
        sys.exit("error: --profile-rounds needs --device cuda")
    profiles = shipped_profiles()
    rows = []
    for shape in args.shapes:
        for dtype_name in args.dtypes:
            target = random_target(shape, getattr(torch, dtype_name), args.device)
            g = torch.Generator().manual_seed(2)
            for batch in args.batch_sizes:
                prompts = [torch.randint(0, target.config.vocab_size, (args.prompt_len,), generator=g)
                           for _ in range(batch)]
                prompts = prompts if batch > 1 else prompts[0]
                for method in args.methods:
                    if method != "ar" and method not in profiles:
                        print(f"skip {method}: no shipped acceptance profile", file=sys.stderr)
                        continue
                    head = None if method == "ar" else random_head(target, method, profiles[method])
                    tree = None if head is None else gpu_tree(target, head, method)
                    accepted = 0.0 if head is None else expected_accepted(
                        head.acceptance, tree.total_tokens, tree.depth, tree.top_k, method)
                    for mode in modes:
                        free_graphs(target)  # (what earlier calls kept: the captures counted are these calls')
                        seconds, reads = timed_rounds(target, head, method, tree, prompts, args.tokens, mode,
                                                      args.profile_rounds)
                        captures = captures_made(target)
                        # A second call: with graphs it replays what the first captured (kept with the target).
                        again, _ = timed_rounds(target, head, method, tree, prompts, args.tokens, mode)
                        captures_again = captures_made(target) - captures
                        if len(seconds) < 3:
                            raise SystemExit(f"error: {len(seconds)} rounds for {args.tokens} tokens: too few to time "
                                             "(the first two are left out)")
                        per_round = statistics.median(seconds[2:])
                        rows.append(dict(device=args.device, shape=shape, dtype=dtype_name, batch=batch, method=method,
                                         graphs=mode, tree="" if tree is None else
                                         f"{tree.total_tokens}/{tree.depth}/{tree.top_k}",
                                         round_ms=round(per_round * 1e3, 3),
                                         rounds=len(seconds), host_reads_per_round=round(reads / len(seconds), 2),
                                         first_round_ms=round(seconds[0] * 1e3, 3), captures=captures,
                                         next_call_first_round_ms=round(again[0] * 1e3, 3),
                                         next_call_captures=captures_again,
                                         expected_tokens_per_round=round(1 + accepted, 3),
                                         predicted_tokens_per_s=round(batch * (1 + accepted) / per_round, 1)))
                        print(rows[-1], flush=True)
                        write_csv(args.out, rows)  # after every row: a stage cut off by its timeout keeps them
            free_graphs(target)
            del target
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
