"""KV compaction after acceptance on a SmolLM2-sized cache (30 layers x K/V in one buffer):
jakiro::compact_kv against the reference (one indexed copy per accepted entry) and against an
eager single gather/scatter over all layers."""
import torch

from common import Table, max_abs_diff, on_device, parse_args, timeit
from jakiro_ext import ops
from jakiro_ext.ops import reference


def eager_gather(cache, prefix_lens, path, path_len):
    for b in range(cache.shape[-4]):
        n, p = int(path_len[b]), int(prefix_lens[b])
        cache[..., b, :, p : p + n, :] = cache[..., b, :, p + path[b, :n], :]


def main():
    args = parse_args(__doc__)
    table = Table("compact_kv", args)
    L, H, D, S = 30, 3, 64, 4096 + 128
    for dtype in (torch.float32, torch.bfloat16):
        for prefix in (1024, 4096):
            cache = torch.randn(L, 2, 1, H, S, D).to(dtype)
            lens = torch.tensor([prefix])
            path = torch.tensor([[0, 3, 9, 17, 31, 45]])
            n = torch.tensor([6])
            cache, lens, path, n = on_device(cache, lens, path, n)
            a, b = cache.clone(), cache.clone()
            ops.compact_kv(a, lens, path, n)
            reference.compact_kv(b, lens, path, n)
            diff = max_abs_diff(a, b)
            t_ours = timeit(lambda: ops.compact_kv(cache, lens, path, n), args.reps)
            t_ref = timeit(lambda: reference.compact_kv(cache, lens, path, n), args.reps)
            t_gather = timeit(lambda: eager_gather(cache, lens, path, n), args.reps)
            table.add(dtype=str(dtype).replace("torch.", ""), layers=L, prefix=prefix, moved=6, max_abs_diff=diff,
                      ours_ms=t_ours["median_ms"], ours_p20_ms=t_ours["p20_ms"], ours_p80_ms=t_ours["p80_ms"],
                      reference_ms=t_ref["median_ms"], eager_gather_ms=t_gather["median_ms"],
                      speedup_vs_reference=t_ref["median_ms"] / t_ours["median_ms"],
                      speedup_vs_eager_gather=t_gather["median_ms"] / t_ours["median_ms"])
    table.save()


if __name__ == "__main__":
    main()
