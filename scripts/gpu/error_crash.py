"""Where an argument check's error crashes on a GPU machine: one op called with a bad argument
on the CPU and then on the GPU, each in its own process, so that a crash of one leaves the
other's answer (and, under cuda-gdb, a native backtrace of the crash).

    python scripts/gpu/error_crash.py [--devices cpu,cuda]   each case in a child process
    python scripts/gpu/error_crash.py cpu|cuda                the one case, in this process

Prints for each case whether the op raised its RuntimeError (its first line) or crashed."""
import subprocess
import sys


def one(device: str) -> None:
    import torch

    import jakiro_ext  # noqa: F401 - registers the ops

    bad = torch.zeros(3, 7, device=device)  # an odd last dimension: not [gate | up]
    try:
        torch.ops.jakiro.silu_mul(bad)
    except RuntimeError as e:
        print(f"{device}: raised RuntimeError: {str(e).splitlines()[0]}")
        return
    print(f"{device}: NO ERROR raised for a bad argument")


if __name__ == "__main__":
    if len(sys.argv) == 2:
        one(sys.argv[1])
        sys.exit(0)
    devices = sys.argv[2].split(",") if len(sys.argv) == 3 and sys.argv[1] == "--devices" else ["cpu", "cuda"]
    for device in devices:
        r = subprocess.run([sys.executable, "-P", __file__, device], capture_output=True, text=True)
        print(r.stdout.strip() or f"{device}: CRASHED (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
