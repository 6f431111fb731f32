"""Issue 24.3: the calibration ranks the pack and ComfyUI's sub-quadratic attention as a one-block run measures them,
on a quiet machine and with the CPU loaded by busy processes.

A child process (ComfyUI's attention module imported there, not into the test process) calibrates with
attention_core.calibrate.measure, then times one real-architecture Wan block (tools.measure.predict_step.WanBlock) with
each attention, both in interleaved rounds. The block is narrow (width 1024 = 8 heads x 128, the calibration's heads;
FFN 4096) so that at 4,096 tokens attention is about half of its time: the ranking is the attention's, not drowned by
the GEMMs both methods share. attention_core.estimate.step_time (blocks=1) from that calibration must rank the two as
the block run did, unless the run or the estimate calls it a tie (within TIE of each other), and the block with the pack
must not be more than TIE slower than with sub-quadratic. The busy case runs one spinning process per core for the whole
child run (calibration and block alike: they race the same load) and kills them after, whatever happened. Measurements
and the cause: docs/bench-busy-cpu.md.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from attention_core.cli import bench
from attention_core.device import machine_load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIE = 0.10       # methods within 10 % of each other: either order is a tie (the load's noise between rounds)
TOKENS = 4096
CHILD = r"""
import json, sys, torch
from attention_core.cli import calibrate, estimate, plan
from attention_core.cli.bench_methods import comfy_attention
from tools.measure import predict_step
comfyui = sys.argv[1]
spec = plan.ModelSpec("narrow-wan", "narrow Wan block", (4, 16, 16), (1, 2, 2), 8, 128, 4096, 1, "test")
plan.MODELS[spec.key] = spec
calibrate.MATH_MAX_SCORES = 0  # math SDPA is not ranked here: not timed, to keep the test short
calib = calibrate.measure("cpu", "fp32", spec.key, tokens=(2048, 4096), comfyui=comfyui)
torch.manual_seed(0)
block = predict_step.WanBlock(dim=spec.width, ffn=spec.ffn, heads=spec.heads)
attn = {"pack": predict_step.pack_attention, "subquad": comfy_attention(comfyui, "comfy-subquad")}
measured = predict_step.block_medians(block, int(sys.argv[2]), attn, torch.device("cpu"), rounds=4)
predicted = {m: estimate.step_time(spec, int(sys.argv[2]), calib, m, batch=1, blocks=1)["total"] for m in attn}
print(json.dumps({"measured": measured, "predicted": predicted, "attention": calib["attention"]}))
"""


def _ranking(times: dict):
    """'pack', 'subquad' (the faster one) or 'tie' (within TIE)."""
    fast, slow = sorted(times, key=times.get)
    return "tie" if times[slow] <= times[fast] * (1 + TIE) else fast


@pytest.mark.parametrize("spinners", [0, machine_load.cores()], ids=["quiet", "busy"])
def test_calibration_ranks_as_a_one_block_run(spinners):
    comfyui = bench.default_comfyui()
    assert comfyui, "ComfyUI not found: set COMFYUI_LATEST_PATH or run ./dev setup"
    env = dict(os.environ, PYTHONPATH=ROOT)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    try:
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-c", CHILD, comfyui, str(TOKENS)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait(timeout=30)
    assert all(p.poll() is not None for p in busy)  # the load is gone, whatever happened
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    measured, predicted = got["measured"], got["predicted"]
    seen = f"measured {measured}, predicted {predicted}, calibration {got['attention']}, {took:.0f} s"
    print(seen)
    ran, said = _ranking(measured), _ranking(predicted)
    assert "tie" in (ran, said) or ran == said, f"the estimate ranks {said} first, the block run {ran}: {seen}"
    # the engine's lead may shrink under load, not turn into a loss (its tiles' parallel regions: issue 24.3)
    assert measured["pack"] <= measured["subquad"] * (1 + TIE), f"the pack lost to sub-quadratic: {seen}"
