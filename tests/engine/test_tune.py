"""attention_core.tune: where profiles live, what tuned_blocks returns (rescaling, budget, switches), that a
tuned tile computes exactly torch's attention, and one real tuning pass on a tiny shape."""
import json
import os
import sys

import pytest
import torch

from attention_core import profiles, tune
from reference import math_sdpa


@pytest.fixture
def profdir(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)  # not inside ComfyUI
    monkeypatch.setenv(profiles.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(profiles.ENV_SWITCH, raising=False)
    profiles._cache.clear()
    return tmp_path


def entry(**kw):
    e = {"tier": "chunked", "dtype": "float32", "heads": 24, "dim": 128, "n": 4096, "rows_timed": 512,
         "block_q": 128, "block_kv": 4096, "heads_per_group": 4, "ms": 1.0, "untuned_ms": 2.0, "use": True}
    e.update(kw)
    return e


def write(entries):
    prof = {"version": profiles.PROFILE_VERSION, "device": "x", "arch": "y", "torch": torch.__version__,
            "entries": entries}
    return profiles.save_profile(prof, "cpu")


def test_profile_path_keyed_by_device_and_torch(profdir):
    path = profiles.profile_path("cpu")
    assert os.path.dirname(path) == str(profdir)
    name, arch = profiles._device_name("cpu")
    assert torch.__version__.replace(".", "-").replace("+", "-").lower() in os.path.basename(path)
    assert arch.lower().replace("_", "-") in os.path.basename(path)


def test_profile_dir_default_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.delenv(profiles.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profiles.profile_dir() == os.path.join(str(tmp_path), "tiled-attention")


def test_profile_dir_inside_comfyui_is_its_user_directory(monkeypatch):
    from comfy_harness import require_comfy
    require_comfy()
    import folder_paths
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    assert profiles.profile_dir() == os.path.join(folder_paths.get_user_directory(), "tiled-attention")


def test_no_profile_no_blocks(profdir):
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30) is None


def test_tuned_blocks_from_the_profile(profdir, monkeypatch):
    write([entry(), entry(tier="online", block_q=256, block_kv=1024, heads_per_group=24),
           entry(dtype="bfloat16", block_q=64, use=False)])
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30) == (128, 4096, 4)
    # twice the keys: half the rows, the tile keeps its tuned number of scores
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 8192, 8192, 128, "chunked", 1 << 30) == (64, 8192, 4)
    # online: block sizes as tuned; "all heads" stays all heads of the call
    assert profiles.tuned_blocks("cpu", torch.float32, 32, 4096, 4096, 128, "online", 1 << 30) == (256, 1024, 32)
    # over the budget: 8 bytes x 128 x 4096 x 4 heads = 16 MB > 8 MB
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 8 << 20) is None
    # a shape where the engine's own plan won, another head dim, the switch off: no tuned tile
    assert profiles.tuned_blocks("cpu", torch.bfloat16, 24, 4096, 4096, 128, "chunked", 1 << 30) is None
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 64, "chunked", 1 << 30) is None
    # a key or head count more than 2x from every tuned one: the engine's own plan
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 1024, 1024, 128, "chunked", 1 << 30) is None
    assert profiles.tuned_blocks("cpu", torch.float32, 4, 4096, 4096, 128, "chunked", 1 << 30) is None
    monkeypatch.setenv(profiles.ENV_SWITCH, "off")
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30) is None


def test_profile_reread_when_it_changes(profdir):
    write([entry()])
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30)[0] == 128
    path = write([entry(block_q=32)])
    os.utime(path, (1, 1))  # a different mtime even within the file system's resolution
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30)[0] == 32


@pytest.mark.parametrize("blocks", [(16, 200, 1), (32, 200, 3), (64, 200, 6)])
def test_run_blocks_is_torch_attention(blocks):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, 200, 32, generator=g) for _ in range(3))
    ref = math_sdpa(q.double(), k.double(), v.double())
    out = tune.run_blocks(q, k, v, blocks)
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_real_tuning_pass_saves_a_profile_the_planner_reads(profdir):
    prof = tune.tune("cpu", ["float32"], [(4, 256, 32)], ["chunked"], rows=64, repeats=1, log=lambda s: None)
    (e,) = prof["entries"]
    assert (e["heads"], e["n"], e["dim"], e["tier"]) == (4, 256, 32, "chunked")
    assert e["block_kv"] == 256 and 4 % e["heads_per_group"] == 0 and e["ms"] > 0 and e["untuned_ms"] > 0
    path = profiles.save_profile(prof, "cpu")
    with open(path) as f:
        assert json.load(f)["entries"][0]["block_q"] == e["block_q"]
    got = profiles.tuned_blocks("cpu", torch.float32, 4, 256, 256, 32, "chunked", 1 << 30)
    assert got == (None if not e["use"] else (e["block_q"], 256, e["heads_per_group"]))


def test_auto_runs_the_profiles_tile_within_the_budget(profdir, monkeypatch):
    """The planner's hook: tier auto takes the profile's tile (here 32 rows, 2 of 4 heads a group), forced
    blocks or TILED_ATTENTION_TUNE=off or a budget the tile exceeds leave the engine's own plan."""
    from attention_core import driver, scaled_dot_product_attention
    write([entry(heads=4, dim=32, n=256, block_q=32, block_kv=256, heads_per_group=2)])
    seen = []
    real = driver.TIERS["chunked"]

    def spy(src, block_q, block_kv, need_stats):
        seen.append((src.p.Hkv, block_q, block_kv))
        return real(src, block_q, block_kv, need_stats)
    monkeypatch.setitem(driver.TIERS, "chunked", spy)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 256, 32, generator=g) for _ in range(3))
    ref = math_sdpa(q.double(), k.double(), v.double())

    out = scaled_dot_product_attention(q, k, v, memory_budget=1 << 30)
    assert seen == [(2, 32, 256), (2, 32, 256)]
    assert (out.double() - ref).abs().max() < 1e-5
    seen.clear()
    scaled_dot_product_attention(q, k, v, memory_budget=1 << 30, block_q=64)
    assert seen == [(4, 64, 256)]
    seen.clear()
    scaled_dot_product_attention(q, k, v, memory_budget=8 * 32 * 256 * 2 - 1)  # one byte short of the tile
    assert seen and all(s != (2, 32, 256) for s in seen)
    seen.clear()
    monkeypatch.setenv(profiles.ENV_SWITCH, "off")
    scaled_dot_product_attention(q, k, v, memory_budget=1 << 30)
    assert seen and all(s != (2, 32, 256) for s in seen)
