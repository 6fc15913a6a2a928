"""The engine on a CUDA device against the CPU engine (runs only where torch sees a GPU and the
library was built with CUDA; the emulated kernels are held to the same in test_engine_emulated.py):
greedy float32 tokens equal for every method, batch 1 and 3. Float rounding differs between the
devices' kernels, so where the two split at a near tie of the target's top-2 logits the test
reports the first divergence and that margin and passes; a split at a clear margin fails."""
import pytest
import torch

from jakiro_ext import ops
from jakiro_ext.engine.generate import speculative_generate
from helpers import PROMPTS
from helpers import HEAD_METHODS, copy_head, tiny_target

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and getattr(ops._C, "with_cuda", 0)),
                                reason="needs a CUDA device and the library built with CUDA")
NEW_TOKENS = 24
NEAR_TIE = 1e-4  # top-2 logit margin (float32 logits of order 1) below which the devices may split


def first_split(target, prompt, want, got):
    """None when equal; else (position, top-2 margin of the CPU target's logits there)."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            ids = torch.cat([prompt, torch.tensor(want[:i], dtype=prompt.dtype)])
            logits, _ = target(ids[None], target.new_cache(1, ids.numel()), last_logits_only=True)
            top = logits[0, -1].float().topk(2).values
            return i, float(top[0] - top[1])
    assert len(want) == len(got), (len(want), len(got))
    return None


@pytest.mark.parametrize("kind,method", [(None, "ar")] + HEAD_METHODS)
@pytest.mark.parametrize("batch", [1, 3])
def test_cuda_greedy_tokens_equal_the_cpu_engine(kind, method, batch):
    cpu_target = tiny_target()
    gpu_target = tiny_target().to("cuda")
    prompts = PROMPTS[:batch]
    runs = {}
    for name, target in (("cpu", cpu_target), ("cuda", gpu_target)):
        head = None if kind is None else copy_head(target, kind)
        out = speculative_generate(target, head, prompts if batch > 1 else prompts[0], NEW_TOKENS, method=method)
        runs[name] = [o.token_ids for o in (out if batch > 1 else [out])]
    for prompt, want, got in zip(prompts, runs["cpu"], runs["cuda"]):
        split = first_split(cpu_target, prompt, want, got)
        if split is not None:
            position, margin = split
            assert margin < NEAR_TIE, (f"{method}: the CUDA engine's token {position} differs from the CPU "
                                       f"engine's where the target's top-2 margin is {margin:.3g}")
            print(f"{method}, batch {batch}: split at token {position}, a near tie (top-2 margin {margin:.3g})")


@pytest.mark.parametrize("kind,method", [(None, "ar"), ("jakiro", "jakiro")])
def test_a_round_reads_the_device_once_on_cuda(kind, method):
    # On the CPU a round's one tolist() is one read; on a GPU it also dispatches the copy to the
    # host, which must not be counted as a second read.
    from jakiro_ext.engine.host_reads import HostReads, counted_rounds

    target = tiny_target().to("cuda")
    head = None if kind is None else copy_head(target, kind)
    with HostReads() as reads, counted_rounds(reads) as rounds:
        speculative_generate(target, head, PROMPTS[0], NEW_TOKENS, method=method)
    in_rounds = sum(v for (where, _), v in reads.counts.items() if where == "round")
    assert rounds[0] >= 3 and in_rounds == rounds[0], (rounds[0], dict(reads.counts))
