"""jakiro::device_errors, the device's error word (issue 15): on a GPU the ops do not read their
index values on the host (a synchronisation per call); the kernels check them, skip the memory
accesses a bad one would direct, and set a bit that the engine reads with its one read per round.
Tested under the SIMT emulator (whose build skips the host checks, as on a GPU) and on CUDA when
there is one."""
import pytest
import torch

from conftest import randn
from jakiro_ext import ops
from jakiro_ext.ops import quantized, reference


def test_device_errors_matches_reference():
    # The CPU ops raise at once, so there is never anything to report on the CPU.
    with pytest.raises(RuntimeError, match=r"lengths\[0\] \+ new tokens"):
        ops.rope_kv_write(randn(1, 2, 4, 8, seed=1), randn(1, 2, 8, seed=2), randn(1, 2, 8, seed=3),
                          torch.zeros(2, 1, 1, 6, 8), torch.tensor([5]))
    word = ops.device_errors(torch.zeros(3))
    assert word.dtype == torch.int32 and word.tolist() == [0]
    assert torch.equal(word, reference.device_errors(torch.zeros(3)))


def test_device_errors_opcheck():
    torch.library.opcheck(torch.ops.jakiro.device_errors.default, (torch.zeros(3),))


def test_device_errors_bad_input_errors():
    with pytest.raises(TypeError, match=r"device_errors: like must be a tensor on the device to ask, got NoneType"):
        ops.device_errors(None)
    # Each bit is named; several at once are all named; an unknown bit is not hidden.
    for bit, message in ops.DEVICE_ERRORS.items():
        with pytest.raises(RuntimeError, match=r"the GPU kernels met bad input values: " + message.split(":")[0]):
            ops.raise_device_errors(bit)
    with pytest.raises(RuntimeError, match=r"rope_kv_write.*; jakiro::verify_tree: a uniform.*; unknown error bits 0x80"):
        ops.raise_device_errors(2 | 32 | 128)
    ops.raise_device_errors(0)


def _cases():
    """(name, op, args, the bit it must set, what must stay untouched: an index into args or None)."""
    logits = randn(1, 4, 10, seed=7)
    parents, tokens = torch.tensor([[-1, 0, 0, 1]]), torch.tensor([[3, 1, 2, 4]])
    mask = ops.build_tree_mask(parents)
    q, k, v = randn(1, 4, 4, 16, seed=4), randn(1, 2, 12, 16, seed=5), randn(1, 2, 12, 16, seed=6)
    qkv = randn(2, 3, 4, 8, seed=8)
    cs = randn(2, 3, 8, seed=9), randn(2, 3, 8, seed=10)
    cache = randn(2, 2, 1, 6, 8, seed=11)
    kv = randn(2, 2, 1, 12, 4, seed=12)
    u = torch.rand(1, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    packed = quantized.from_float(randn(32, 64, seed=13), "Q4_1")
    return [
        ("tree_attention prefix beyond the cache", "tree_attention", (q, k, v, torch.tensor([9]), mask), 1, None),
        ("tree_attention negative prefix", "tree_attention", (q, k, v, torch.tensor([-3]), mask), 1, None),
        ("rope_kv_write lengths beyond the cache", "rope_kv_write", (qkv, *cs, cache, torch.tensor([1, 4])), 2, 3),
        ("rope_kv_write negative length", "rope_kv_write", (qkv, *cs, cache, torch.tensor([-1, 0])), 2, 3),
        ("compact_kv path beyond the cache", "compact_kv",
         (kv, torch.tensor([5, 4]), torch.tensor([[0, 9], [0, 1]]), torch.tensor([2, 2])), 4, 0),
        ("compact_kv path not increasing", "compact_kv",
         (kv, torch.tensor([5, 4]), torch.tensor([[1, 0], [0, 1]]), torch.tensor([2, 2])), 4, 0),
        ("compact_kv path_len beyond the path", "compact_kv",
         (kv, torch.tensor([5, 4]), torch.tensor([[0, 1], [0, 1]]), torch.tensor([3, 2])), 4, 0),
        ("verify_tree a parent after its child", "verify_tree", (torch.tensor([[-1, 0, 3, 1]]), tokens, logits), 8, None),
        ("verify_tree a root with a parent", "verify_tree", (torch.tensor([[0, 0, 0, 1]]), tokens, logits), 8, None),
        ("verify_tree a token beyond the vocabulary", "verify_tree", (parents, torch.tensor([[3, 1, 10, 4]]), logits),
         16, None),
        ("verify_tree a negative token", "verify_tree", (parents, torch.tensor([[3, -1, 2, 4]]), logits), 16, None),
        ("verify_tree a uniform of 1", "verify_tree", (parents, tokens, logits, u.index_fill(1, torch.tensor([2]), 1.0),
                                                      1.0), 32, None),
        ("verify_tree a NaN uniform", "verify_tree", (parents, tokens, logits, u.index_fill(1, torch.tensor([4]),
                                                                                           float("nan")), 1.0), 32, None),
        ("dequantize_rows a row beyond the weight", "dequantize_rows", (packed, torch.tensor([3, 32])), 64, None),
        ("dequantize_rows a negative row", "dequantize_rows", (packed, torch.tensor([[-1]])), 64, None),
    ]


@pytest.mark.parametrize("case", range(len(_cases())), ids=[c[0].replace(" ", "-") for c in _cases()])
def test_gpu_device_errors_matches_reference(gpu_backend, case):
    _, op, args, bit, untouched = _cases()[case]
    args = [gpu_backend.to_device(a) for a in args]
    like = args[0]
    assert gpu_backend.ops.device_errors(like).tolist() == [0]  # (cleared by an earlier call)
    before = args[untouched].clone() if untouched is not None else None
    getattr(gpu_backend.ops, op)(*args)
    assert gpu_backend.ops.device_errors(like).tolist() == [bit]
    assert gpu_backend.ops.device_errors(like).tolist() == [0]  # read once, then cleared
    if before is not None:  # the bad sequence's entries were neither written nor moved
        changed = (args[untouched] != before).flatten(2 if op == "rope_kv_write" else 0)
        if op == "rope_kv_write":  # the good sequence (row 0 or 1) is written, the bad one not
            bad_row = 1 if int(args[4][1]) == 4 else 0
            assert not bool(changed[:, bad_row].any()) and bool(changed[:, 1 - bad_row].any())
        else:  # compact_kv: sequence 0 is bad (nothing moves), sequence 1 moves nothing anyway (path 0, 1)
            assert not bool(changed.any())
    # Good inputs report nothing.
    good = {"tree_attention": lambda a: (*a[:3], torch.tensor([2]).to(a[0].device), a[4]),
            "rope_kv_write": lambda a: (*a[:4], torch.tensor([1, 2]).to(a[0].device)),
            "compact_kv": lambda a: (a[0], a[1], torch.tensor([[0, 1], [0, 1]]).to(a[0].device),
                                     torch.tensor([2, 2]).to(a[0].device)),
            "verify_tree": lambda a: (torch.tensor([[-1, 0, 0, 1]]).to(a[0].device), torch.tensor([[3, 1, 2, 4]]).to(
                a[0].device), a[2], *([torch.full((1, 5), 0.5, dtype=torch.float64).to(a[0].device), 1.0]
                                      if len(a) > 3 else [])),
            "dequantize_rows": lambda a: (a[0], torch.tensor([0, 31]).to(a[0].device))}[op]
    getattr(gpu_backend.ops, op)(*good(args))
    assert gpu_backend.ops.device_errors(like).tolist() == [0]


def test_gpu_dequantize_rows_bad_row_is_nan_and_its_neighbours_exact(gpu_backend):
    """A bad row among good ones: its weights NaN (none read), the others the reference's bits."""
    packed = quantized.from_float(randn(32, 64, seed=14), "Q8_0")
    out = gpu_backend.run("dequantize_rows", packed, torch.tensor([5, 40, 31]))
    assert gpu_backend.ops.device_errors(gpu_backend.to_device(packed)).tolist() == [64]
    assert bool(out[1].isnan().all())
    assert torch.equal(out[[0, 2]], reference.dequantize_rows(packed, torch.tensor([5, 31])))


@pytest.mark.parametrize("bad", ["prefix beyond the cache", "negative prefix"])
def test_gpu_tree_attention_bad_sequence_reads_nothing_and_its_neighbour_is_exact(gpu_backend, bad):
    """A batch of a good and a bad sequence: the bad one attends to nothing (zeros, log-sum-exp
    -inf: no key was read), the good one's output is its reference's alone."""
    parents = torch.tensor([[-1, 0, 0, 1]] * 2)
    mask = ops.build_tree_mask(parents)
    q, k, v = randn(2, 4, 4, 16, seed=4), randn(2, 2, 12, 16, seed=5), randn(2, 2, 12, 16, seed=6)
    lengths = torch.tensor([2, 9 if bad == "prefix beyond the cache" else -3])
    out, lse = gpu_backend.run("tree_attention", q, k, v, lengths, mask)
    assert gpu_backend.ops.device_errors(gpu_backend.to_device(q)).tolist() == [1]
    want_out, want_lse = reference.tree_attention(q[:1], k[:1], v[:1], lengths[:1], mask[:1])
    torch.testing.assert_close(out[:1], want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[:1], want_lse, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(lse[1].isneginf().all())


@pytest.mark.parametrize("bad", ["parent after its child", "token beyond the vocabulary"])
def test_gpu_verify_tree_bad_sequence_stays_in_bounds_and_its_neighbour_is_exact(gpu_backend, bad):
    """A batch of a good and a bad tree: the good one's path, accepted length and bonus are its
    reference's alone; the bad one's outputs stay in range (nodes of its tree, a token of the
    vocabulary), whatever the bad value, and the round that reads the bit emits none of them."""
    logits = randn(2, 4, 10, seed=7)
    logits[:, 0, 1] = logits[:, 1, 4] = 50.0  # both trees would accept 1 then 4 (nodes 1, 3)
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 3, 1] if bad == "parent after its child" else [-1, 0, 0, 1]])
    tokens = torch.tensor([[3, 1, 2, 4], [3, 1, 2, 4] if bad == "parent after its child" else [3, 1, 10, 4]])
    path, accepted, bonus = gpu_backend.run("verify_tree", parents, tokens, logits)
    assert gpu_backend.ops.device_errors(gpu_backend.to_device(logits)).tolist() == [8 if "parent" in bad else 16]
    want = reference.verify_tree(parents[:1], tokens[:1], logits[:1])
    assert torch.equal(path[:1], want[0]) and torch.equal(accepted[:1], want[1]) and torch.equal(bonus[:1], want[2])
    assert int(want[1][0]) == 2  # (the good tree accepts a path, so "exact" says something)
    T = parents.shape[1]
    assert bool(((path[1] >= -1) & (path[1] < T)).all()) and 0 <= int(accepted[1]) < T and 0 <= int(bonus[1]) < 10
