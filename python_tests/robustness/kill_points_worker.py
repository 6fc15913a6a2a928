"""Kill a writer at every file-system boundary and check what is left (run by test_robustness.py).

``python kill_points_worker.py ARTIFACT DIR`` writes the old version of ARTIFACT (head,
checkpoint, shard or cache) into DIR, then for n = 0, 1, 2, ...: forks a child that writes the new
version and SIGKILLs itself just before its n-th file-system call (open, mkdir, link, fsync,
rename, exchange, unlink, rmdir), the file it opened last cut short as by a kill mid-write. The parent then checks that DIR holds the whole old or the whole
new artifact, runs what the next start runs (the removal of stale temporaries), checks again and
that no temporary is left, and restores the old version. It stops at the first n the child
finishes before reaching, and prints one JSON object: the outcome of every kill point.
"""
import builtins
import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch

from jakiro_ext import atomic
from jakiro_ext.training.corpus import CorpusSequence, CorpusWriter, read_corpus
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.train import previous_checkpoint, read_checkpoint, write_checkpoint
from jakiro_ext.training.feature_cache import read_feature_shard, save_feature_shard

torch.set_num_threads(1)  # nothing multi-threaded before fork
CONFIG = dict(hidden_size=16, vocab_size=64, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24)


# ----------------------------------------------------------------------------- the artifacts
def head(version: int) -> DraftHead:
    kind = "jakiro" if version == 0 else "eagle2"
    h = DraftHead(DraftConfig(num_experts=4 if kind == "jakiro" else 0, **CONFIG)).init_weights(seed=version)
    h.acceptance = {"depth_rank": [[0.5, 0.25]], "positions": 7} if version == 0 else None
    return h


class Head:
    """A Jakiro head with an acceptance profile and training.json, overwritten by an EAGLE-2
    head without them; a checkpoint beside them must survive either way."""

    def __init__(self, d: Path):
        self.path = d / "head"

    def write(self, version: int) -> None:
        head(version).save(self.path, extra_files={"training.json": f"run {version}\n"} if version == 0 else None)
        if version == 0:
            (self.path / "checkpoint.pt").write_bytes(b"checkpoint")

    def state(self) -> int:
        loaded = DraftHead.load(self.path)
        version = 0 if loaded.config.kind == "jakiro" else 1
        want = head(version).state_dict()
        assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items()), "weights of neither head"
        assert (loaded.acceptance is not None) == (version == 0), "an acceptance profile of the other head"
        assert (self.path / "training.json").exists() == (version == 0), "training.json of the other head"
        assert (self.path / "checkpoint.pt").read_bytes() == b"checkpoint", "the checkpoint beside the head was lost"
        return version

    def directory(self) -> Path:
        return self.path.parent


class Checkpoint:
    def __init__(self, d: Path):
        self.path = d / "checkpoint.pt"

    def write(self, version: int) -> None:
        write_checkpoint(self.path, {"head": {"w": torch.full((64,), float(version))}, "optimizer": {}, "schedule": {},
                                     "step": version + 1, "config": {}})

    def state(self) -> int:
        state = read_checkpoint(self.path)
        version = state["step"] - 1
        assert torch.equal(state["head"]["w"], torch.full((64,), float(version)))
        if version == 1:  # the one it replaced is kept whole
            assert read_checkpoint(previous_checkpoint(self.path))["step"] == 1
        return version

    def directory(self) -> Path:
        return self.path.parent


class Shard:
    """A corpus of one shard, to which a second shard is added."""

    def __init__(self, d: Path):
        self.path = d / "corpus"

    def sequences(self, version: int):
        return [CorpusSequence(version, 0, torch.arange(5) + version, 2)]

    def write(self, version: int) -> None:
        writer = CorpusWriter(self.path, dict(vocab_size=100), shard_answer_tokens=1)
        for v in range(version + 1) if not (self.path / "corpus.json").exists() else [version]:
            for q in self.sequences(v):
                writer.add(q)

    def state(self) -> int:
        got = [(q.conversation, q.tokens.tolist()) for q in read_corpus(self.path)]
        for version in (0, 1):
            want = [(q.conversation, q.tokens.tolist()) for v in range(version + 1) for q in self.sequences(v)]
            if got == want:
                return version
        raise AssertionError(f"the corpus holds neither version: {got}")

    def directory(self) -> Path:
        return self.path


class Cache:
    def __init__(self, d: Path):
        self.path = d / "features" / "shard-00000.safetensors"

    def tokens(self, version: int) -> torch.Tensor:
        return torch.arange(6) + version

    def write(self, version: int) -> None:
        q = CorpusSequence(0, 0, self.tokens(version), 2)
        save_feature_shard(self.path, [q], [torch.full((6, 4), float(version))])

    def state(self) -> int:
        for version in (0, 1):
            features = read_feature_shard(self.path, self.tokens(version))
            if features is not None:
                assert torch.equal(features.float(), torch.full((6, 4), float(version)))
                return version
        raise AssertionError("the cache file holds neither version")

    def directory(self) -> Path:
        return self.path.parent


ARTIFACTS = dict(head=Head, checkpoint=Checkpoint, shard=Shard, cache=Cache)


# ----------------------------------------------------------------------------- the kills
def arm(kill_at: int) -> None:
    """SIGKILL this process just before its ``kill_at``-th file-system call. A kill can also fall
    while a file's bytes are being written: the file this process opened last, if it still
    exists under that name and was written by this process, is first cut to half its size."""
    calls, opened = [0], [None]
    before = {st.st_ino: (st.st_mtime_ns, st.st_size) for st in (p.stat() for p in ROOT.rglob("*") if p.is_file())}

    def tear_and_kill():
        path = opened[0]
        if path is not None and os.path.isfile(path):
            st = os.stat(path)
            if before.get(st.st_ino) != (st.st_mtime_ns, st.st_size):  # written by this process
                os.truncate(path, st.st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn, records=False):
        def hooked(*args, **kwargs):
            if calls[0] == kill_at:
                tear_and_kill()
            calls[0] += 1
            if records and isinstance(args[0], (str, bytes, os.PathLike)):
                opened[0] = os.fsdecode(args[0])
            return fn(*args, **kwargs)
        return hooked

    for name in ("mkdir", "link", "fsync", "rename", "replace", "unlink", "remove", "rmdir", "symlink"):
        setattr(os, name, wrap(getattr(os, name)))
    os.open = wrap(os.open, records=True)
    builtins.open = io.open = wrap(io.open, records=True)
    atomic._exchange = wrap(atomic._exchange)


def temporaries(directory: Path):
    return sorted(p.name for p in directory.parent.rglob("*") if atomic.TEMP_PATTERN.fullmatch(p.name)
                  or p.name.endswith(".tmp"))


ROOT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")


def main(kind: str, root: Path) -> dict:
    artifact = ARTIFACTS[kind](root)
    outcomes = []
    for kill_at in range(1000):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        artifact.write(0)
        pid = os.fork()
        if pid == 0:
            arm(kill_at)
            artifact.write(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            raise SystemExit(f"the writer failed at kill point {kill_at}: status {status}")
        try:
            before = artifact.state()
            atomic.remove_stale_temporaries(artifact.directory())  # what the next start does
            atomic.remove_stale_temporaries(artifact.directory().parent)
            after = artifact.state()
            left = temporaries(artifact.directory())
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            before = after = None
            left, error = [], f"{type(exc).__name__}: {exc}"
        outcomes.append(dict(kill_at=kill_at if killed else None, before=before, after=after, left=left, error=error))
        if not killed:
            break
    return dict(artifact=kind, outcomes=outcomes)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))))
