"""What the `mode` tooltips (Patch Attention, Tiled Attention Everywhere) and docs/nodes.md say about each tier's memory,
measured (issue 30.9). The words (nodes/attention.py, nodes/everywhere_node.py, docs/nodes.md's Patch Attention table):

  chunked  fastest tier (a time claim: docs/benchmarks.md, not measured here)
  inplace  less memory than chunked on a GPU, where chunked keeps a second score buffer (P beside S); on the CPU
           (whose chunked softmax writes over its own scores) the two hold about the same
  online   least memory at the default tile size (its tiles aim at a quarter of the others' scores:
           kernel.memory.ONLINE_TILE_ELEMS, one key tile alive at a time), and its tiles shrink the furthest (the
           least it can run with: 16 x 16 scores, the others 16 full rows), so `auto` falls back to it when nothing
           else fits

Default settings: memory_budget 0, so the tiles take their default size (kernel.memory's targets) from a share of
the free memory (fixed here at 32 GB). Shape: Wan 2.2 5B at 832x480x9 frames, 1,170 tokens of 24 heads x 128, in
WanVideoWrapper's convention [B, H, N, D] and in ComfyUI's layout. Device kinds: the CPU, and a GPU's rules on the
CPU (tests/support/attention_shapes.gpu_rules: targets, budget share, chunked's S and P in two buffers).
Each check also holds for the planner's totals (attention_core.plan), so the planner says what is measured.
"""
import logging

import pytest
import torch

from attention_core.cli import plan
from attention_core.kernel import memory, ops
from live_bytes import peak_bytes
from attention_shapes import gpu_rules, inputs

HEADS, N, DIM = 24, 1170, 128
FREE = 32 << 30
# (kind, input dtype, precision): WanVideoWrapper's bf16 on the CPU (computed in fp32 there) and fp32; on a GPU
# fp16 and bf16 kept as they are (Patch Attention's half_precision keep)
SETTINGS = [("cpu", torch.bfloat16, "auto"), ("cpu", torch.float32, "auto"),
            ("gpu", torch.float16, "input"), ("gpu", torch.bfloat16, "input")]
IDS = [f"{k}-{str(d).replace('torch.', '')}" for k, d, _ in SETTINGS]


def held(q, k, v, tier, precision, budget=None):
    """Bytes a call holds beyond q, k, v, its output and the output's fp32 row statistics."""
    b, h, n, d = q.shape
    return peak_bytes(lambda: ops.attention_forward(q, k, v, tier=tier, precision=precision,
                                                    memory_budget=budget)) - b * h * n * (d * q.dtype.itemsize + 8)


def planned(kind, dtype, precision, layout, free=FREE):
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return plan.estimate("wan22-5b", 832, 480, 9, free=free, dtype_bytes=dtype.itemsize, cpu=kind == "cpu",
                         dtype=name, precision=precision, layout=layout)


def at_defaults(monkeypatch, kind, dtype, precision, layout):
    """{tier: bytes held} of each tier forced, memory_budget 0 (tiles from free memory, fixed at FREE)."""
    monkeypatch.setattr(memory, "free_memory", lambda device: FREE)
    if kind == "gpu":
        gpu_rules(monkeypatch)
    q, k, v = inputs(layout, dtype, HEADS, N, DIM)
    return {t: held(q, k, v, t, precision) for t in plan.TIERS}


@pytest.mark.parametrize("layout", ["heads", "comfyui"])
@pytest.mark.parametrize("kind,dtype,precision", SETTINGS, ids=IDS)
def test_online_holds_the_least_and_inplace_no_more_than_chunked_at_the_default_tile_size(kind, dtype, precision,
                                                                                         layout, monkeypatch):
    """online holds the least of the three (at most 3/4 of inplace's); on a GPU chunked holds a second score buffer
    (P beside S: at least half a buffer more than inplace, net of the rows' tensors, which differ by tier), on the
    CPU about the same as inplace (within 10 %). The planner's totals order the tiers the same way."""
    got = at_defaults(monkeypatch, kind, dtype, precision, layout)
    est = planned(kind, dtype, precision, layout)
    tiers = est["tiers"]
    say = {t: f"{b / 2**20:.1f} MB" for t, b in got.items()}
    assert got["online"] <= 0.75 * got["inplace"], say
    assert tiers["online"]["total"] < tiers["inplace"]["total"]
    if kind == "gpu":
        assert got["inplace"] < got["chunked"], say
        tile = tiers["chunked"]["tile"]  # 1,168 of the 1,170 rows: the default tile holds almost every score
        one_buffer = tile["heads"] * tile["rows"] * tile["keys"] * plan.DTYPE_BYTES[est["compute"]]
        assert got["chunked"] - got["inplace"] >= one_buffer / 2, (say, one_buffer)
        assert tiers["inplace"]["total"] < tiers["chunked"]["total"]
    else:
        assert abs(got["inplace"] - got["chunked"]) <= 0.1 * got["chunked"], say
        assert abs(tiers["inplace"]["total"] - tiers["chunked"]["total"]) <= 0.1 * tiers["chunked"]["total"]
    for t in plan.TIERS:  # and the planner is never below what each tier holds
        assert tiers[t]["total"] >= got[t], (t, say, tiers[t])


@pytest.mark.parametrize("kind,dtype,precision", SETTINGS, ids=IDS)
def test_online_shrinks_furthest_and_is_what_auto_falls_back_to(kind, dtype, precision, monkeypatch, caplog):
    """The least each tier can run with (the planner's floor, the engine's own sizing rule): online's 16 x 16 tile is
    the smallest, below inplace's and chunked's 16 full rows. With a budget under inplace's floor, auto and both
    forced full-row tiers run online's tiles (the forced ones say so in the log), holding exactly what online holds.
    (One of the model's heads: at this budget online's tiles are 1 head x 24 rows x 256 keys, thousands of them for
    24 heads.)"""
    if kind == "gpu":
        gpu_rules(monkeypatch)
    est = planned(kind, dtype, precision, "heads")
    floors = {t: est["tiers"][t]["floor"] for t in plan.TIERS}
    assert floors["online"] < floors["inplace"] <= floors["chunked"], floors  # chunked: S and P on a GPU
    assert (floors["inplace"] < floors["chunked"]) == (kind == "gpu"), floors
    budget = floors["inplace"] - 1
    q, k, v = inputs("heads", dtype, 1, N, DIM)
    online = held(q, k, v, "online", precision, budget)
    with caplog.at_level(logging.WARNING, logger="attention_core.kernel.driver"):
        others = {t: held(q, k, v, t, precision, budget) for t in ("auto", "chunked", "inplace")}
    assert others == {"auto": online, "chunked": online, "inplace": online}
    assert sum("does not fit" in r.getMessage() and "using the next tier down" in r.getMessage()
               for r in caplog.records) == 2
    small = planned(kind, dtype, precision, "heads", free=int(budget / memory.FREE_FRACTION[
        "cpu" if kind == "cpu" else "other"]) + 1)
    assert small["auto_tier"] == "online" and [t for t in plan.TIERS if small["tiers"][t]["tile"]] == ["online"]


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CLAIMS = {  # file -> the words the tests above measure (a change of words must come with a change of measurement)
    "nodes/attention.py": ["chunked: fastest tier. inplace: softmax in the score tile; less memory than chunked on a "
                           "GPU (the same on the CPU). online: FlashAttention-2 recurrence; least memory at the "
                           "default tile size, and its tiles shrink the furthest (auto falls back to it when nothing "
                           "else fits)."],
    "nodes/everywhere_node.py": ["(chunked: fastest; inplace: less memory than chunked on a GPU; online: least "
                                 "memory, and what runs when nothing else fits)"],
    "docs/nodes.md": ["`inplace` (less memory than `chunked` on a GPU, where chunked keeps a second score buffer; on "
                      "the CPU the two hold about the same), `online` (least memory at the default tile size, and its "
                      "tiles shrink the furthest, so `auto` falls back to it when nothing else fits)"],
}


@pytest.mark.parametrize("path", sorted(CLAIMS))
def test_the_words_are_the_measured_ones(path):
    """The tooltips and docs/nodes.md say exactly what the tests above measure, and nothing says inplace is "least
    memory" (online holds less at the default tile size)."""
    import re
    text = ROOT.joinpath(path).read_text()
    if path.endswith(".py"):  # the tooltip as Python joins it: adjacent string literals
        text = re.sub(r'"\s*\n\s*(f?)"', "", text)
    for claim in CLAIMS[path]:
        assert claim in text, (path, claim)
    assert not re.search(r"inplace[^.;]{0,40}least memory", text), path
