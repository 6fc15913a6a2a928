"""compact_kv against its reference, in place, on every layout the engine uses."""
import pytest
import torch

from conftest import randn
from jakiro_ext import ops
from jakiro_ext.ops import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(), (3,), (4, 2)], ids=["one-cache", "layers", "layers-kv"])
def test_compact_kv_matches_reference(lead, dtype):
    B, H, S, D = 3, 5, 200, 64
    cache = randn(*lead, B, H, S, D, seed=1, dtype=dtype)
    prefix_lens = torch.tensor([0, 57, 139])
    path = torch.tensor([[0, 1, 4, 9, 30, -1], [0, 3, -1, -1, -1, -1], [0, 2, 5, 6, 7, 60]])
    path_len = torch.tensor([5, 2, 6])
    want = cache.clone()
    reference.compact_kv(want, prefix_lens, path, path_len)
    untouched = cache.clone()
    ops.compact_kv(cache, prefix_lens, path, path_len)
    assert torch.equal(cache, want)
    # Sanity of the spec itself: row prefix + j now holds what was at prefix + path[j].
    assert torch.equal(cache[..., 2, :, 139 + 5, :], untouched[..., 2, :, 139 + 60, :])
    assert torch.equal(cache[..., 0, :, 5:, :], untouched[..., 0, :, 5:, :])  # nothing past the path moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.covers("compact_kv", "adversarial_shapes")
def test_compact_kv_adversarial_shapes(dtype):
    """Head dim 1, one head, the root alone (nothing moves), a path to the cache's last slot, an
    empty prefix, a path longer than one sequence's and a batch of one."""
    for B, H, S, D, prefix, path, path_len in [
            (1, 1, 3, 1, [0], [[0, 2]], [2]),
            (2, 1, 9, 1, [0, 4], [[0, -1, -1], [0, 1, 4]], [1, 3]),
            (3, 2, 40, 3, [30, 0, 1], [[0, 9], [0, 39], [0, 1]], [2, 2, 1])]:
        cache = randn(2, B, H, S, D, seed=S, dtype=dtype)
        args = (torch.tensor(prefix), torch.tensor(path), torch.tensor(path_len))
        want = cache.clone()
        reference.compact_kv(want, *args)
        ops.compact_kv(cache, *args)
        assert torch.equal(cache, want), (B, H, S, D)


def test_compact_kv_opcheck():
    cache = randn(2, 2, 3, 40, 8, seed=2)
    args = (cache, torch.tensor([3, 10]), torch.tensor([[0, 2, 5], [0, 1, -1]]), torch.tensor([3, 2]))
    torch.library.opcheck(torch.ops.jakiro.compact_kv.default, args)


def test_compact_kv_bad_input_errors():
    cache = randn(2, 3, 40, 8, seed=3)
    lens, path, n = torch.tensor([3, 10]), torch.tensor([[0, 2, 5], [0, 1, -1]]), torch.tensor([3, 2])
    cases = [
        ((cache, lens, torch.tensor([[0, 5, 2], [0, 1, -1]]), n), r"path\[0\] must hold strictly increasing"),
        ((cache, lens, path, torch.tensor([4, 2])), r"path_len\[0\] must be in \[0, path.shape\[1\] = 3\], got 4"),
        ((cache, torch.tensor([3, 39]), path, n), r"prefix_lens\[1\] \+ path\[1, 1\] = 40 is beyond the cache capacity 40"),
        ((cache[:, :, :, :4], lens, path, n), r"cache must be contiguous"),
        ((cache[0], lens, path, n), r"cache must have shape \[..., B, H, S, D\]"),
        ((cache, lens.int(), path, n), r"prefix_lens must have dtype Long"),
        ((cache, lens, path[:1], n), r"path.shape\[0\] \(batch, as cache.shape\[-4\]\) must be 2"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.compact_kv(*args)
