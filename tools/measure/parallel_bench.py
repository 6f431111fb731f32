"""Per-rank time and memory of sequence-parallel attention on CPU processes against one process at the same N.

    python -m tools.measure.parallel_bench --tokens 8192 --heads 8 --dim 64 --ranks 2 4

For each P it starts P processes (gloo over 127.0.0.1, one intra-op thread each), gives every rank N/P tokens of
one float32 problem and times attention_core.parallel.ulysses_attention and ring_attention (plain and causal),
forward only; the baseline is attention_core.scaled_dot_product_attention on all N tokens in one process with one
thread. Memory is the rise of the process's resident set over the inputs (Linux VmHWM, reset before each call via
/proc/self/clear_refs; glibc told to mmap blocks over 64 KB so freed memory leaves the RSS), so it counts everything
the call allocates: tiles, all-to-all buffers, ring blocks. Wall times suffer from other load on the machine; the
CPU seconds per rank are the steadier figure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<group>/x.py


def _rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _measure(call, repeats):
    """(best wall seconds, CPU seconds of that run, peak RSS rise in MB over the state before the call)."""
    best = None
    for _ in range(repeats):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        base = _rss_kb("VmRSS:")
        w0, c0 = time.perf_counter(), time.process_time()
        out = call()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        peak = (_rss_kb("VmHWM:") - base) / 1024
        del out
        if best is None or wall < best[0]:
            best = (wall, cpu, peak)
    return best


def _engine_kwargs(args):
    return {"memory_budget": args.memory_budget_mb << 20} if args.memory_budget_mb else {}


def _warm_up():
    """The engine's first call in a process pays one-time setup; keep it out of the figures."""
    import torch
    from attention_core import scaled_dot_product_attention
    q = torch.randn(1, 2, 64, 16)
    scaled_dot_product_attention(q, q, q)


def _problem(args, dtype):
    import torch
    g = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.tokens, args.dim)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(3)]


def rank_main(rank, world, init, args, out_path):
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from attention_core import parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    n = args.tokens // world
    q, k, v = (t[:, :, rank * n:(rank + 1) * n].contiguous() for t in _problem(args, torch.float32))
    res, kw = {}, _engine_kwargs(args)
    _warm_up()
    with torch.no_grad():
        for algo in ("ulysses", "ring"):
            for causal in (False, True):
                fn = getattr(parallel, f"{algo}_attention")
                dist.barrier()
                res[f"{algo}{' causal' if causal else ''}"] = _measure(lambda: fn(q, k, v, is_causal=causal, **kw),
                                                                       args.repeats)
    with open(out_path, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def single(args):
    import torch
    sys.path.insert(0, ROOT)
    from attention_core import scaled_dot_product_attention
    torch.set_num_threads(1)
    q, k, v = _problem(args, torch.float32)
    kw = _engine_kwargs(args)
    _warm_up()
    with torch.no_grad():
        return {f"one process{' causal' if c else ''}":
                _measure(lambda: scaled_dot_product_attention(q, k, v, is_causal=c, **kw), args.repeats)
                for c in (False, True)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.measure.parallel_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--memory-budget-mb", type=int, default=64,
                    help="the engine's tile budget on every rank (0: its default, a share of free memory)")
    ap.add_argument("--rank-worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # large blocks mmapped, so freed memory leaves the RSS
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
        raise SystemExit(subprocess.call([sys.executable, "-m", "tools.measure.parallel_bench", *sys.argv[1:]],
                                         cwd=ROOT, env=env))
    if args.rank_worker:
        rank, world, init, out = args.rank_worker
        return rank_main(int(rank), int(world), init, args, out)
    print(f"N={args.tokens}, H={args.heads}, D={args.dim}, float32, forward, 1 thread per process, "
          f"{os.cpu_count()} CPU cores, engine tile budget {args.memory_budget_mb or 'default'} MB")
    print(f"{'':22} {'P':>2} {'wall s (max rank)':>18} {'CPU s (per rank)':>17} {'peak MB (max rank)':>19}")
    for name, (wall, cpu, mb) in single(args).items():
        print(f"{name:22} {1:>2} {wall:18.2f} {cpu:17.2f} {mb:19.0f}")
    for world in args.ranks:
        tmp = tempfile.mkdtemp(prefix="parallel-bench-")
        init = "file://" + os.path.join(tmp, "rendezvous")
        common = ["--tokens", str(args.tokens), "--heads", str(args.heads), "--dim", str(args.dim),
                  "--repeats", str(args.repeats), "--memory-budget-mb", str(args.memory_budget_mb)]
        procs = [subprocess.Popen([sys.executable, "-m", "tools.measure.parallel_bench", *common, "--rank-worker",
                                   str(r), str(world), init, os.path.join(tmp, f"{r}.json")], cwd=ROOT,
                                  env=os.environ) for r in range(world)]
        if any(p.wait() for p in procs):
            raise SystemExit(f"a rank of the {world}-process run failed")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"{r}.json")) as f:
                ranks.append(json.load(f))
        for name in ranks[0]:
            wall = max(x[name][0] for x in ranks)
            cpu = sum(x[name][1] for x in ranks) / world
            mb = max(x[name][2] for x in ranks)
            print(f"{name:22} {world:>2} {wall:18.2f} {cpu:17.2f} {mb:19.0f}")


if __name__ == "__main__":
    main()
