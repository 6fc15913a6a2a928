"""Nothing lost, nothing unclear: artifacts survive a kill at every file boundary, outputs are
checked before the work, damaged files are named (a damaged cache is recomputed), SIGINT and
SIGTERM end the commands cleanly with the work saved, and running out of memory is one line."""
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import jakiro_ext
from jakiro_ext import atomic
from jakiro_ext.cli import main
from jakiro_ext.training.corpus import generate_corpus, read_corpus_meta, read_shard
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.train import previous_checkpoint, read_checkpoint, write_checkpoint
from jakiro_ext.training.features import corpus_examples
from jakiro_ext.training.feature_cache import read_feature_shard

HERE = Path(__file__).parent
# The children import the jakiro_ext this test imported (installed or in place).
ENV = dict(os.environ, PYTHONPATH=str(Path(jakiro_ext.__file__).parent.parent))
TINY = dict(hidden_size=16, vocab_size=64, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24)
CONVERSATIONS = [[{"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]
                 for q in ("Tell me a long story about a dragon.", "Explain how rain forms, in detail.",
                           "Write a poem about the sea.", "Describe a city at night.")]


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    return lines[0]


def last_line(stderr: str) -> str:
    """The last line of a command that drew progress bars before its error; no traceback."""
    assert "Traceback" not in stderr, stderr
    return [line for line in re.split(r"[\r\n]", stderr) if line.strip()][-1]


def cli(args, env=ENV, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jakiro_ext", *args], capture_output=True, text=True, cwd="/",
                          env=env, timeout=600, **kw)


# ----------------------------------------------------------------------------- kills
@pytest.mark.parametrize("artifact", ["head", "checkpoint", "shard", "cache"])
def test_a_kill_at_every_file_boundary_leaves_the_old_or_the_new_artifact(artifact, tmp_path):
    """A writer SIGKILLed before each of its file-system calls in turn: the directory holds the
    whole old or the whole new artifact, before and after the next start's clean-up, and no
    temporary survives that clean-up."""
    run = subprocess.run([sys.executable, str(HERE / "kill_points_worker.py"), artifact, str(tmp_path / "w")],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr
    outcomes = json.loads(run.stdout)["outcomes"]
    assert len(outcomes) >= 5 and outcomes[-1]["kill_at"] is None  # several boundaries, then a whole write
    for o in outcomes:
        assert o["error"] is None, o
        assert o["before"] in (0, 1) and o["after"] == o["before"] and o["left"] == [], o
    assert outcomes[0]["before"] == 0 and outcomes[-1]["before"] == 1
    assert {o["before"] for o in outcomes[:-1]} == {0, 1} or artifact != "head"  # the swap is one step


# ----------------------------------------------------------------------------- head directories
def tiny_head(kind: str, seed: int) -> DraftHead:
    return DraftHead(DraftConfig(num_experts=4 if kind == "jakiro" else 0, **TINY)).init_weights(seed=seed)


def test_rewriting_a_head_leaves_no_stale_file_and_keeps_other_files(tmp_path):
    old = tiny_head("jakiro", 0)
    old.acceptance = {"depth_rank": [[0.5]]}
    old.save(tmp_path / "h", extra_files={"training.json": "{}\n"})
    (tmp_path / "h" / "checkpoint.pt").write_bytes(b"state")
    tiny_head("eagle2", 1).save(tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["checkpoint.pt", "config.json", "model.safetensors"]
    loaded = DraftHead.load(tmp_path / "h")
    assert loaded.config.kind == "eagle2" and loaded.acceptance is None  # --tree auto cannot use the old profile
    assert (tmp_path / "h" / "checkpoint.pt").read_bytes() == b"state"
    assert [p.name for p in tmp_path.iterdir()] == ["h"]  # no temporary beside it
    with pytest.raises(ValueError, match="extra files"):
        old.save(tmp_path / "h", extra_files={"notes.txt": ""})


def test_stale_temporaries_are_removed_and_a_half_swapped_directory_put_back(tmp_path):
    child = subprocess.Popen(["true"])
    child.wait()
    dead = child.pid  # a process that is gone
    (tmp_path / f".x.tmp-{dead}-abcdef").write_text("partial")
    (tmp_path / f".h.old-{dead}-abcdef").mkdir()  # killed between the fallback's two renames
    (tmp_path / f".y.tmp-{os.getpid()}-abcdef").write_text("a live writer's")
    atomic.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".y.tmp-{os.getpid()}-abcdef", "h"]


def test_directory_swap_without_exchange_support(tmp_path, monkeypatch):
    """Where renameat2 is missing, two renames: the result is the same."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    tiny_head("jakiro", 0).save(tmp_path / "h")
    tiny_head("eagle2", 1).save(tmp_path / "h")
    assert DraftHead.load(tmp_path / "h").config.kind == "eagle2" and [p.name for p in tmp_path.iterdir()] == ["h"]


def test_writes_behind_keep_the_newest_text_report_failures_and_finish_before_exit(tmp_path, monkeypatch):
    """A file written behind the caller: the newest text of a path wins, a failure reaches the
    callback, a wait returns once all is written, and a process that exits right after
    submitting still writes it (the writer thread is waited for)."""
    started, release = threading.Event(), threading.Event()
    real = atomic.write_text

    def slow_write(path, text):  # the first write held until more are submitted behind it
        started.set()
        release.wait(10)
        real(path, text)
    monkeypatch.setattr(atomic, "write_text", slow_write)
    errors = []
    atomic.write_text_behind(tmp_path / "a", "1", errors.append)
    assert started.wait(10)
    atomic.write_text_behind(tmp_path / "a", "2", errors.append)  # pending: replaced by the next
    atomic.write_text_behind(tmp_path / "a", "3", errors.append)
    (tmp_path / "dir").write_text("")
    atomic.write_text_behind(tmp_path / "dir" / "b", "x", errors.append)  # (its directory is a file)
    release.set()
    atomic.wait_for_writes_behind()
    assert (tmp_path / "a").read_text() == "3" and len(errors) == 1 and isinstance(errors[0], OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "dir"]  # no temporary left
    code = ("import sys, time; from jakiro_ext import atomic; real = atomic.write_text\n"
            "atomic.write_text = lambda p, t: (time.sleep(0.5), real(p, t))\n"
            f"atomic.write_text_behind({str(tmp_path / 'c')!r}, 'kept', print); sys.exit(0)")
    subprocess.run([sys.executable, "-c", code], env=ENV, check=True, timeout=60)
    assert (tmp_path / "c").read_text() == "kept"


# ----------------------------------------------------------------------------- outputs checked first
def test_output_check_names_the_directory_and_the_space(tmp_path, monkeypatch):
    atomic.check_output_dir(tmp_path / "a" / "b", 1, "x")
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: type("U", (), {"free": 5 << 20})())
    with pytest.raises(OSError, match=r"has 5 MB free, but the checkpoints needs about 10 MB"):
        atomic.check_output_dir(tmp_path / "a", 10 << 20, "the checkpoints")


def read_only_run(directory: Path, args) -> subprocess.CompletedProcess:
    """The command with ``directory`` read-only: a read-only bind mount in a mount namespace of
    its own (root), else the directory's permissions (which bind everyone but root)."""
    command = [sys.executable, "-m", "jakiro_ext", *args]
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
    else:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"root without mount namespaces (unshare -m: {probe.stderr.decode().strip()}): no read-only mount")
        d = str(directory)
        command = ["unshare", "-m", "sh", "-c", f'mount --bind "{d}" "{d}" && mount -o remount,bind,ro "{d}" "{d}" && '
                   'exec "$@"', "sh", *command]
    return subprocess.run(command, capture_output=True, text=True, cwd="/", env=ENV, timeout=600)


@pytest.mark.parametrize("command", ["train", "corpus"])
def test_an_unwritable_output_is_refused_before_any_work(command, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    t0 = time.perf_counter()
    run = read_only_run(locked, [command, "--out", str(locked / "out")])
    assert run.returncode == 2, run.stderr
    line = one_line_error(run.stderr)
    assert re.fullmatch(rf"error: {locked / 'out'} cannot hold the (checkpoints|corpus): "
                        r"(Read-only file system|Permission denied)", line), line
    assert time.perf_counter() - t0 < 60  # no model was loaded, no data read


def private_cache(tmp_path: Path) -> dict:
    """An environment whose $JAKIRO_CACHE is new but holds the default model (linked)."""
    from jakiro_ext.models.default import DEFAULT_MODEL, default_model_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / DEFAULT_MODEL).symlink_to(default_model_dir())
    return dict(ENV, JAKIRO_CACHE=str(cache))


def file_size_limit(nbytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


@pytest.fixture(scope="module")
def default():
    from jakiro_ext.models.default import load_default_target

    return load_default_target()


@pytest.fixture(scope="module")
def small_corpus(default, tmp_path_factory):
    """A two-shard corpus of the default model's answers to four questions."""
    target, tokenizer = default
    path = tmp_path_factory.mktemp("corpus") / "c"
    convs = [[{"role": "user", "content": c[0]["value"]}] for c in CONVERSATIONS]
    generate_corpus(path, target, tokenizer, "SmolLM2", 40, conversations=convs, max_new_tokens=12, max_turns=1,
                    batch=2, shard_answer_tokens=20, progress=False)
    assert len(read_corpus_meta(path)["shards"]) == 2
    return path


def copy_corpus(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


TRAIN = ["--kind", "eagle2", "--steps", "2", "--batch", "2", "--draft-vocab", "0", "--eval-every-nth", "0",
         "--threads", "1"]


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_full_disk_during_training_is_one_line_and_leaves_nothing_behind(checkpoints, small_corpus, tmp_path):
    """A file-size limit stands in for a full disk: the probe passes, the checkpoint (or, without
    checkpoints, the head) cannot be written."""
    corpus = copy_corpus(small_corpus, tmp_path / "corpus")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    env = private_cache(tmp_path)
    args = ["train", "--out", str(out), "--data", str(corpus)] + TRAIN + (
        [] if checkpoints else ["--checkpoint-every", "0"])
    run = cli(args, preexec_fn=file_size_limit(4 << 20), env=env)
    assert run.returncode == 2, run.stderr
    line = last_line(run.stderr)
    name = out / "checkpoint.pt" if checkpoints else out
    assert line == f"error: {name} could not be written: File too large (is the disk full?); nothing was replaced"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "corpus", "out"]


def test_a_full_disk_during_corpus_generation_keeps_the_saved_shards(tmp_path):
    conversations = tmp_path / "convs.json"
    conversations.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(CONVERSATIONS)]))
    out = tmp_path / "c"
    args = ["corpus", "--out", str(out), "--conversations", str(conversations), "--answer-tokens", "40",
            "--max-new-tokens", "12", "--generation-batch", "2", "--max-turns", "1"]
    # The feature cache's first shard (bf16 features of ~100 tokens: ~120 kB) is over the limit.
    run = cli(args, preexec_fn=file_size_limit(60_000), env=private_cache(tmp_path))
    assert run.returncode == 2
    line = last_line(run.stderr)
    assert re.fullmatch(r"error: \S+shard-00000\.safetensors could not be written: File too large \(is the disk "
                        r"full\?\); nothing was replaced", line), line
    assert not (out / "corpus.json").exists() and list(out.iterdir()) == []


# ----------------------------------------------------------------------------- damaged files
def test_damaged_shards_and_corpus_json_are_named_with_the_remedy(small_corpus, tmp_path, default):
    corpus = copy_corpus(small_corpus, tmp_path / "c")
    shard = corpus / "shard-00001.npz"
    good = shard.read_bytes()
    shard.write_bytes(good[:-1])
    with pytest.raises(ValueError, match=rf"corpus shard {shard} is damaged \(BadZipFile: .*\): delete it and run the "
                                         rf"corpus command on {corpus} again"):
        read_shard(shard)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    record = read_corpus_meta(corpus)["shards"][1]
    with pytest.raises(ValueError, match=rf"corpus shard {shard} is damaged \(ValueError: its sha256 differs from the "
                                         r"one corpus.json records\)"):
        read_shard(shard, record["sha256"])
    # Resuming the generation reads every shard: the same message, no traceback.
    target, tokenizer = default
    with pytest.raises(ValueError, match=rf"corpus shard {shard} is damaged"):
        generate_corpus(corpus, target, tokenizer, "SmolLM2", 10_000, conversations=[], max_new_tokens=12,
                        max_turns=1, batch=2, shard_answer_tokens=20, progress=False)
    # The remedy works: the deleted shard's sequences are generated again.
    shard.unlink()
    convs = [[{"role": "user", "content": c[0]["value"]}] for c in CONVERSATIONS]
    generate_corpus(corpus, target, tokenizer, "SmolLM2", 40, conversations=convs, max_new_tokens=12, max_turns=1,
                    batch=2, shard_answer_tokens=20, progress=False)
    key = lambda q: (q.conversation, q.tokens.tolist())  # noqa: E731
    from jakiro_ext.training.corpus import read_corpus

    assert sorted(map(key, read_corpus(corpus))) == sorted(map(key, read_corpus(small_corpus)))
    # A truncated corpus.json.
    meta = corpus / "corpus.json"
    meta.write_text(meta.read_text()[:40])
    with pytest.raises(ValueError, match=rf"{meta} is damaged \(.*\): restore it"):
        read_corpus_meta(corpus)
    run = cli(["train", "--out", str(tmp_path / "h"), "--data", str(corpus)] + TRAIN,
              env=private_cache(tmp_path))
    assert run.returncode == 2 and last_line(run.stderr).startswith(f"error: {meta} is damaged")


def test_a_damaged_checkpoint_is_named_with_the_previous_one(tmp_path):
    path = tmp_path / "checkpoint.pt"
    for step in (1, 2):
        write_checkpoint(path, {"head": {}, "optimizer": {}, "schedule": {}, "step": step, "config": {}})
    assert read_checkpoint(path)["step"] == 2 and read_checkpoint(previous_checkpoint(path))["step"] == 1
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"checkpoint {path} is damaged \(.*\): resume from the previous checkpoint "
                                         rf"\(mv {previous_checkpoint(path)} {path}\) or delete it to start over"):
        read_checkpoint(path)
    previous_checkpoint(path).unlink()
    with pytest.raises(ValueError, match=r"is damaged \(.*\): delete it to start over"):
        read_checkpoint(path)


def test_a_damaged_feature_cache_is_recomputed_with_a_warning(small_corpus, tmp_path, default, capsys):
    target, _ = default
    fresh, _ = corpus_examples(small_corpus, target, tmp_path / "f", progress=False)
    cached = tmp_path / "f" / "shard-00000.safetensors"
    cached.write_bytes(cached.read_bytes()[:-10])
    capsys.readouterr()
    again, _ = corpus_examples(small_corpus, target, tmp_path / "f", progress=False)
    assert f"warning: the feature cache file {cached} is damaged" in capsys.readouterr().err
    assert all(torch.equal(a.features, b.features) for a, b in zip(fresh, again))
    tokens = torch.cat([q.tokens for q in read_shard(small_corpus / "shard-00000.npz")])
    assert read_feature_shard(cached, tokens) is not None  # written again, whole


def test_a_killed_emulator_build_does_not_hold_up_the_next():
    # torch's build lock (the file "lock"), left behind by an emulator build killed mid-way, made
    # every later build wait for it forever: the next one goes on, and removes it.
    from jakiro_ext.ops import emulator

    build = emulator.build_root() / "w32"
    build.mkdir(parents=True, exist_ok=True)
    (build / "lock").touch()
    code = "from jakiro_ext.ops import emulator; print(emulator.emulated_ops(32).linear)"
    # (the build directory named: a subprocess that imports another copy of the package, as with
    # a relative PYTHONPATH from "/", would otherwise build in that copy's own)
    env = {**os.environ, "JAKIRO_SIMT_BUILD_DIR": str(emulator.build_root().resolve())}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, cwd="/", env=env)
    assert out.returncode == 0 and "jakiro_simt32.linear" in out.stdout, out.stderr[-2000:]
    assert not (build / "lock").exists()


def test_damaged_cost_cache_is_measured_again(tmp_path, monkeypatch, capsys):
    from jakiro_ext.engine import tree_cost

    monkeypatch.setattr(tree_cost, "costs_key", lambda *a: "k")
    measured = {"verify": {"1": 0.01, "2": 0.01}, "draft": {"1,1": 0.01}, "catch_up": {"1": 0.01, "2": 0.01},
                "context": 256, "context_slope": 0.0}
    monkeypatch.setattr(tree_cost, "measure_costs", lambda *a, **k: measured)
    (tmp_path / "k.json").write_text('{"verify": ')
    expected = dict(measured, build=tree_cost.build_id())
    assert tree_cost.load_costs(None, None, "jakiro", tmp_path, progress=False) == expected
    assert "the cached costs" in capsys.readouterr().err
    assert json.loads((tmp_path / "k.json").read_text()) == expected


# ----------------------------------------------------------------------------- signals
def start(args, env=ENV) -> subprocess.Popen:
    # SIGINT restored to its default in the child: a suite started in the background of a shell
    # (`pytest &`) inherits SIGINT ignored, and a Python started so never raises KeyboardInterrupt.
    return subprocess.Popen([sys.executable, "-m", "jakiro_ext", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd="/", env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(proc: subprocess.Popen, stream: str, pattern: str, timeout: float = 300) -> str:
    """Read ``stream`` of ``proc`` until ``pattern`` is seen; what was read."""
    pipe, seen, t_end = getattr(proc, stream), b"", time.monotonic() + timeout
    while time.monotonic() < t_end:
        ready, _, _ = select.select([pipe], [], [], 1.0)
        if ready:
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
            if re.search(pattern, seen.decode(errors="replace")):
                return seen.decode(errors="replace")
    proc.kill()
    raise AssertionError(f"{pattern!r} never came on {stream}: {seen.decode(errors='replace')[-2000:]}")


def finish(proc: subprocess.Popen, sig: int, before: str = ""):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out.decode(), (before + err.decode()).split("\r")[-1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_generate_ends_cleanly_on_a_signal(sig):
    proc = start(["generate", "Write a very long story about a dragon.", "--method", "ar", "--max-new-tokens",
                  "4000", "--threads", "1"])
    wait_for(proc, "stdout", r"\w+ \w+ \w+")
    code, out, err = finish(proc, sig)
    assert code == 128 + sig
    line = one_line_error(err)
    assert re.fullmatch(rf"interrupted by {signal.Signals(sig).name} while generating; \d+ tokens had been generated",
                        line), line


def test_bench_prints_the_finished_prompts_statistics_on_sigint(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Say hi.", "Name a colour."]
                               + ["Write a very long story about a dragon."] * 20))
    proc = start(["bench", "--prompts", str(prompts), "--method", "ar", "--max-new-tokens", "4000", "--threads", "1"])
    seen = wait_for(proc, "stderr", r"bench: [^\r]*\b2/22\b")
    code, out, err = finish(proc, signal.SIGINT, seen)
    assert code == 130
    # Prompt 3 or, on a loaded machine where the signal comes late, a later one: the statistics
    # are those of the prompts before it.
    m = re.fullmatch(r"interrupted by SIGINT while benchmarking prompts (\d+)-\1 of 22; the statistics of the (\d+) "
                     r"prompts finished are printed", err.strip().splitlines()[-1])
    assert m and int(m[1]) >= 3 and int(m[2]) == int(m[1]) - 1, err
    assert "Traceback" not in err and re.search(r"\noverall.*\n  ar\s+[\d.]+ tokens/s", out), out


def test_corpus_saves_its_finished_sequences_on_sigterm(tmp_path):
    conversations = tmp_path / "convs.json"
    conversations.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(CONVERSATIONS * 8)]))
    out = tmp_path / "c"
    proc = start(["corpus", "--out", str(out), "--conversations", str(conversations), "--max-new-tokens", "200",
                  "--generation-batch", "1", "--max-turns", "1", "--threads", "1"],
                 env=private_cache(tmp_path))
    seen = wait_for(proc, "stderr", r"answers: [^\r]*\|\s*[1-9]\d*/")  # an answer is finished
    code, _, err = finish(proc, signal.SIGTERM, seen)
    assert code == 143
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and re.fullmatch(
        rf"interrupted by SIGTERM while generating the corpus {out}; {out} holds 1 shards, [1-9]\d* answer tokens, "
        r"the finished sequences included; the same command resumes", line), err
    shards = read_corpus_meta(out)["shards"]
    assert len(shards) == 1 and shards[0]["answer_tokens"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["corpus.json", "shard-00000.npz"]


def test_training_saves_a_checkpoint_on_sigterm_and_resumes_from_it(small_corpus, tmp_path):
    corpus = copy_corpus(small_corpus, tmp_path / "corpus")
    out = tmp_path / "h"
    env = private_cache(tmp_path)
    args = ["train", "--out", str(out), "--data", str(corpus), "--kind", "eagle2", "--steps", "100000", "--batch", "2",
            "--draft-vocab", "0", "--eval-every-nth", "0", "--checkpoint-every", "100000", "--threads", "1"]
    proc = start(args, env)
    seen = wait_for(proc, "stderr", r"train eagle2:[^\r]*\b[1-9]\d*/100000")
    code, _, err = finish(proc, signal.SIGTERM, seen)
    assert code == 143
    line = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"interrupted by SIGTERM while training the eagle2 head \(step \d+ of 100000\); {out}/checkpoint.pt "
                     r"holds the first (\d+) steps; the same command resumes from there", line)
    assert "Traceback" not in err and m, err
    steps = int(m[1])
    assert steps >= 1 and read_checkpoint(out / "checkpoint.pt")["step"] == steps
    # The same command resumes from the saved step (with fewer steps asked it is refused clearly).
    run = cli([("2" if a == "100000" and args[i - 1] == "--steps" else a) for i, a in enumerate(args)], env=env)
    assert run.returncode == 2 and "was written by a run with other settings" in last_line(run.stderr)


# ----------------------------------------------------------------------------- memory, prompts
OOM_CHILD = """
import resource, sys
import transformers, jakiro_ext.cli, jakiro_ext.models.default  # imported before the limit, and what
import transformers.models.llama.modeling_llama  # loading imports lazily (it once took more than the room left)
def vm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
limit = vm() + (64 << 20)  # room for 64 MB more: the model's 540 MB of float32 weights do not fit
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
if sys.argv[1] == "api":
    try:
        jakiro_ext.models.default.load_default_target()
    except MemoryError as exc:
        print("MemoryError:", exc)
else:
    sys.exit(jakiro_ext.cli.main(["generate", "Hi", "--max-new-tokens", "2", "--threads", "1"]))
"""


@pytest.mark.parametrize("where", ["api", "cli"])
def test_out_of_memory_while_loading_is_a_memory_error_and_one_line(where, default):
    run = subprocess.run([sys.executable, "-c", OOM_CHILD, where], capture_output=True, text=True, cwd="/", env=ENV,
                         timeout=300)
    pattern = r"out of memory while loading the target model SmolLM2-135M-Instruct \(torch.float32\)( \(an allocation of [\d.]+ MiB failed\))?"
    if where == "api":
        assert run.returncode == 0 and re.fullmatch("MemoryError: " + pattern, run.stdout.strip()), run.stdout + run.stderr
    else:
        assert run.returncode == 2 and re.fullmatch("error: " + pattern, one_line_error(run.stderr)), run.stderr


def test_bench_names_the_prompt_over_the_context_limit(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n" + json.dumps({"question_id": 81, "prompt": "word " * 9000})
                       + "\n")
    assert main(["bench", "--prompts", str(prompts), "--method", "ar", "--max-new-tokens", "2"]) == 2
    assert re.fullmatch(rf"error: {prompts}:2: prompt 81 has \d+ tokens, but the target's context holds 8192 positions "
                        r"\(max_position_embeddings\): leave it out or shorten it", one_line_error(capsys.readouterr().err))
