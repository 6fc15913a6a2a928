"""The GPU machine's work, run here on the CPU so that it does not rot between GPU windows: the
training check of ``scripts/gpu/check_training.py`` and the stage driver's refusals."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_gpu_training_check_passes_on_the_cpu():
    run = subprocess.run([sys.executable, "scripts/gpu/check_training.py", "--device", "cpu", "--steps", "30"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all checks held (cpu)" in run.stdout and "FAIL" not in run.stdout
    assert run.stdout.count("ok   ") == 13  # the features, then 4 checks for each of the 3 kinds


def test_the_gpu_stage_driver_refuses_an_unknown_stage(tmp_path):
    run = subprocess.run(["bash", "scripts/gpu/run.sh", "nonsense"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, JAKIRO_GPU_WORK=str(tmp_path), PYTHON=sys.executable))
    assert run.returncode == 2 and "unknown stage nonsense" in run.stderr


def test_the_gpu_stage_driver_dry_run_reports_every_stage_it_ran():
    """(The whole dry run, every stage, is a step of scripts/test.sh; here the driver's frame.)"""
    run = subprocess.run(["bash", "scripts/gpu/run.sh", "--dry-run", "probe", "train"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "device copy:" in run.stdout and "bf16 matmul" in run.stdout
    assert "| probe | passed |" in run.stdout and "| train | passed |" in run.stdout
    assert "device: cpu (dry run)" in run.stdout and run.stdout.rstrip().endswith("exit 0")
