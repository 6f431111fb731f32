"""Ulysses sends each kv head to the ranks that need it, with as few copies as the head split allows.

With Hkv kv heads over P ranks and Hkv % P != 0, the kv heads are copied r times (the smallest r dividing the
group size H / Hkv with P | Hkv * r) before the all-to-all; with P | Hkv they are sent as they are. Copying them
all H / Hkv times gives the same output with up to P times the kv traffic and memory, so this counts the bytes a
rank hands to torch.distributed.all_to_all_single during one forward call (gloo, 4 CPU processes), and checks the
output against torch's math SDPA.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 4
CASES = {  # name -> (H, Hkv); B = 1, n = 4 tokens per rank, D = 16, float64
    "kv_copied_twice": (8, 2),  # Hkv % P = 2: 2 copies (4 kv heads, one per rank), not all 4 (8 heads)
    "mqa": (8, 1),  # gcd(1, 4) = 1: 4 copies (one kv head a rank), not all 8
    "kv_odd": (12, 3),  # gcd(3, 4) = 1: 4 copies, here all of them (12 heads)
    "kv_split_as_is": (8, 4),  # P | Hkv: no copies
    "mha": (4, 4),
}
B, N_LOCAL, D = 1, 4, 16


def fewest_copies(H, Hkv, P):
    if Hkv % P == 0:
        return 1
    g = H // Hkv
    return min(r for r in range(1, g + 1) if g % r == 0 and (Hkv * r) % P == 0)


def worker(rank, init, out_path):
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from attention_core import parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    sent = []
    real = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return real(output, input, *args, **kwargs)
    dist.all_to_all_single = counting
    results = {}
    for name, (H, Hkv) in CASES.items():
        g = torch.Generator().manual_seed(H * 10 + Hkv)
        N = N_LOCAL * WORLD
        q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64) for _ in range(2))
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        rows = slice(rank * N_LOCAL, (rank + 1) * N_LOCAL)
        sent.clear()
        out = parallel.ulysses_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], enable_gqa=True)
        results[name] = {"sent": sum(sent), "err": (out - ref[:, :, rows]).abs().max().item()}
    with open(out_path, "w") as f:
        json.dump(results, f)
    # as test_parallel.py's workers: exit without tearing the gloo group down (on torch 2.5.1
    # destroy_process_group could block a rank here after its results were written)
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_copies")
    init = "file://" + str(tmp / "rendezvous")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), init,
                               str(tmp / f"rank{r}.json")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(WORLD)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail("the 4-process group did not finish in 300 s (a hang)")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    out = {}
    for r in range(WORLD):
        with open(tmp / f"rank{r}.json") as f:
            out[r] = json.load(f)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_ulysses_sends_the_fewest_kv_copies(runs, case):
    H, Hkv = CASES[case]
    r = fewest_copies(H, Hkv, WORLD)
    per_head = B * N_LOCAL * D * 8  # one head's rows of this rank, float64
    # q and the output go out once each (all H heads); k and v with their r copies
    expected = (2 * H + 2 * Hkv * r) * per_head
    # room for a log-sum-exp of every head and row (fp64) should the call ever send one; far less than one more
    # kv copy (2 x Hkv x D values a row)
    lse = B * H * N_LOCAL * 8
    for rank in range(WORLD):
        res = runs[rank][case]
        assert res["err"] < 1e-12, (case, rank, res)
        assert expected <= res["sent"] <= expected + lse, (
            f"{case} rank {rank}: {res['sent']} bytes sent, expected {expected} ({r} copy/copies of {Hkv} kv heads "
            f"over {WORLD} ranks)")


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--worker":
    worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
