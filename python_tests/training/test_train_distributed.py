"""Data-parallel training under torchrun (issue 16): 2 CPU processes (gloo) take the same steps
as one process running the same global batches (losses, accuracies and weights to float
rounding), and a run checkpointed by 2 processes resumes on 1."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddp_train_worker as worker
from conftest import TEST_PATH
import jakiro_ext
from jakiro_ext.training.distributed import Ranks
from jakiro_ext.training.train import train_head

PACKAGE_HOME = Path(jakiro_ext.__file__).resolve().parent.parent


def torchrun(processes: int, *args) -> None:
    # The jakiro_ext this test imported (installed, or a checkout's in-place build), and the tests.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_HOME), *TEST_PATH]), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                          str(Path(worker.__file__)), *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]


def close(a: list, b: list) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for key in x:
            if key.startswith(("loss", "eval_loss")) or key == "lr":
                assert x[key] == pytest.approx(y[key], rel=1e-4), (x["step"], key)
            elif key != "step":  # accuracies: a near tie may flip one argmax
                assert abs(x[key] - y[key]) <= 0.05, (x["step"], key, x[key], y[key])


def test_two_processes_follow_one_and_resume_on_one(tmp_path):
    torch.set_num_threads(1)
    _, head, train, held_out = worker.setup()
    alone = train_head(head, train, worker.CONFIG, held_out)
    out = tmp_path / "two"
    out.mkdir()
    torchrun(2, out, tmp_path / "two.ckpt")
    ran = sorted(p.name for p in out.glob("rank-*"))
    assert ran == ["rank-0-of-2", "rank-1-of-2"], ran  # two processes of one group took every step
    assert {(out / r).read_text() for r in ran} == {f"{worker.CONFIG.steps} steps\n"}
    together = json.loads((out / "history.json").read_text())
    close(together, alone)
    assert len(alone) == worker.CONFIG.steps and "eval_acc1" in alone[-1]
    weights = torch.load(out / "head.pt")
    for name, value in head.state_dict().items():
        torch.testing.assert_close(weights[name], value, atol=2e-5, rtol=1e-4)
    # The 2-process run's checkpoint of step 3 resumes on one process, to the same end.
    shutil.copy(out / "snapshot.pt", tmp_path / "resumed.ckpt")
    _, again, _, _ = worker.setup()
    resumed = train_head(again, train, worker.CONFIG, held_out, checkpoint=tmp_path / "resumed.ckpt")
    close(resumed, together)
    for name, value in again.state_dict().items():
        torch.testing.assert_close(weights[name], value, atol=2e-5, rtol=1e-4)


def test_a_batch_smaller_than_the_processes_is_an_error():
    _, head, train, _ = worker.setup("eagle2")
    with pytest.raises(ValueError, match=r"a batch of 4 sequences cannot be shared by 8 processes"):
        train_head(head, train, worker.CONFIG, ranks=Ranks(0, 8))
