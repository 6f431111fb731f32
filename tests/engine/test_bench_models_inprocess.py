"""The model benchmarks' case code run in this process (the benchmark itself runs each case in a fresh child, where
no in-process test or mutant run sees it): the Qwen 2.5 prefill and decode cases with each method, Z-Image's
attention override in ComfyUI's layouts against float64 attention, and the shared time-and-memory reader."""
import types

import pytest
import torch

from attention_core.cli.bench_models import measure, qwen, zimage
from attention_core.kernel import counts

pytest.importorskip("transformers")


def _qwen_case(kind, method, n=64, repeats=2):
    return dict(kind=kind, method=method, n=n, depth=1, dtype="float32", device="cpu", repeats=repeats, threads=0,
                vocab=512, seed=0)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_qwen_cases_run_each_method_and_the_engine_takes_every_call(kind):
    for method in ("engine", "math", "torch"):
        res = qwen.run_case(_qwen_case(kind, method))
        assert res["ms"] > 0 and res["peak_mb"] >= 0, res
        if method == "engine":  # one attention call per layer and run: depth 1 x 2 repeats
            assert (res["routed"], res["passed"], res["expected"]) == (2, 0, 2), res
        else:
            assert "routed" not in res, res


def test_qwen_decode_steps_each_see_the_same_cache(monkeypatch):
    """Every measured decode step attends to N cached tokens plus its own (cropped after it): after the warm-up
    (a 32-token cache) the engine's calls all have N + 1 keys."""
    from attention_core import sdpa
    seen = []
    real = sdpa.scaled_dot_product_attention

    def spy(query, key, *a, **k):
        seen.append(key.shape[-2])
        return real(query, key, *a, **k)
    monkeypatch.setattr(sdpa, "scaled_dot_product_attention", spy)
    res = qwen.run_case(_qwen_case("decode", "engine", n=40, repeats=3))
    assert res["routed"] == 3 and seen == [33, 41, 41, 41], seen  # the warm-up's 32 + 1, then N + 1 each step


def test_qwen_model_and_options():
    cfg = qwen.config(2, vocab=300)
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size) == (2, 300, 896, 14, 2, 4864)
    assert qwen.config(1).vocab_size == qwen.VOCAB
    with pytest.raises(ValueError, match="unknown method 'flash'"):
        qwen._method("flash")
    a = types.SimpleNamespace(sizes=[1024, 1000], methods=["engine", "math"], depth=1, dtype="float32",
                              device="cpu", repeats=2, threads=0, vocab=qwen.VOCAB)
    rows = qwen.cases("prefill", a, 4, budget=2 ** 30)
    assert [label for label, _ in rows] == ["1K", "1000"]
    assert rows[0][1]["engine"]["n"] == 1024 and isinstance(rows[0][1]["math"], dict)
    over = qwen.cases("prefill", a, 4, budget=2 ** 20)[0][1]["math"]
    assert isinstance(over, str) and "out of memory here" in over and "--memory-budget-gb" in over


def _comfy_layout(t):  # (B, heads, N, d) -> ComfyUI's (B, N, heads * d)
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


@pytest.mark.parametrize("mask_kind", [None, "2d-float", "3d-bool", "4d-float"])
@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("kind", ["engine", "math"])
def test_zimage_override_is_exact_in_comfyuis_layouts(kind, skip_reshape, mask_kind):
    g = torch.Generator().manual_seed(3)
    heads, n, d = 3, 20, 16
    q, k, v = (torch.randn(2, heads, n, d, generator=g) for _ in range(3))
    mask = ref_mask = None
    if mask_kind == "2d-float":
        mask = torch.randn(n, n, generator=g)
        ref_mask = mask.double()
    elif mask_kind == "3d-bool":
        mask = torch.rand(2, n, n, generator=g) > 0.3
        mask[..., 0] = True
        ref_mask = mask.unsqueeze(1)
    elif mask_kind == "4d-float":
        mask = torch.randn(2, 1, n, n, generator=g)
        ref_mask = mask.double()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=ref_mask)
    counts.reset(zimage.COUNT_KEY)
    args = (q, k, v) if skip_reshape else tuple(_comfy_layout(t) for t in (q, k, v))
    out = zimage._override(kind)(None, *args, heads, mask, skip_reshape=skip_reshape,
                                 skip_output_reshape=skip_reshape)
    want = ref if skip_reshape else _comfy_layout(ref)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert float((out.double() - want).abs().max()) < 1e-5
    assert counts.calls(zimage.COUNT_KEY)[0] == (1 if kind == "engine" else 0)
    counts.reset(zimage.COUNT_KEY)


def test_zimage_tokens_cases_and_titles():
    assert zimage.tokens(1024, 77) == (4096, 96)  # 128 latent, 64 x 64 patches; text padded to 32
    assert zimage.tokens(536, 40) == (1120, 64)  # 67 latent -> 33 patches a side: 1089, padded to 1120
    a = types.SimpleNamespace(sizes=[512], methods=["math", "auto", "comfy-subquad"], text_tokens=77,
                              dtype="float32", device="cpu", repeats=2, threads=0, comfyui=None, quick=False,
                              dit_sizes=[512], dit_methods=["engine"], depth=1, refiners=1)
    (label, per), = zimage.attention_cases(a, 4, budget=2 ** 40)
    assert label == "512² (1,120)" and per["auto"]["n"] == 1120 and per["auto"]["heads"] == zimage.HEADS
    assert per["comfy-subquad"] == "no ComfyUI (--comfyui or COMFYUI_PATH)"
    assert "out of memory here" in zimage.attention_cases(a, 4, budget=2 ** 20)[0][1]["math"]
    assert zimage.dit_cases(a, 4, 2 ** 40)[0][1]["engine"].startswith("no ComfyUI")
    a.comfyui = "/somewhere"
    dit = zimage.dit_cases(a, 4, 2 ** 40)[0][1]["engine"]
    assert (dit["width"], dit["side"], dit["text"]) == (zimage.DIM, 512, 96)
    a.quick = True
    assert zimage.dit_cases(a, 4, 2 ** 40)[0][1]["engine"]["width"] == zimage.QUICK_DIT_WIDTH
    # math in the DiT step holds 2 x heads x N^2 scores: 2 x 30 x 1,120^2 x 4 B = 0.28 GiB at 512^2 (full width)
    a.quick, a.dit_methods = False, ["math", "engine"]
    need = 2 * zimage.HEADS * 1120 ** 2 * 4
    over = zimage.dit_cases(a, 4, need - 1)[0][1]
    assert "math SDPA needs ~0.3 GB for the scores, over the 0.3 GB budget" in over["math"]
    assert isinstance(over["engine"], dict)  # the engine's case is never refused for memory
    assert zimage.dit_cases(a, 4, need)[0][1]["math"]["method"] == "math"
    assert isinstance(zimage.dit_cases(a, 4, 2 ** 26)[0][1]["math"], str)  # 64 MiB: far under the scores
    a.quick = True
    title, dit_title = zimage.describe(a)
    assert "N = image + 96 text tokens" in title and f"width {zimage.QUICK_DIT_WIDTH} (3 x 128 heads)" in dit_title


def test_default_comfyui_is_the_first_real_comfyui(monkeypatch, tmp_path):
    real = tmp_path / "real"
    (real / "comfy").mkdir(parents=True)
    (real / "comfy" / "model_management.py").write_text("")
    monkeypatch.setenv("COMFYUI_LATEST_PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("COMFYUI_PATH", str(real))
    assert zimage.default_comfyui() == str(real)
    monkeypatch.setenv("COMFYUI_LATEST_PATH", str(real))
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "empty"))
    assert zimage.default_comfyui() == str(real)


def test_measured_gives_the_first_calls_memory_and_the_median_of_the_rest():
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 1:
            x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MB touched in the first call only
            x.add_(1)
    res = measure.measured(fn, "cpu", 3)
    assert len(calls) == 3 and res["ms"] >= 0
    assert 48 <= res["peak_mb"] < 256, res  # the first call's 64 MB in MB (peak RSS growth; some may be mapped)
    one = measure.measured(lambda: None, "cpu", 1)
    assert set(one) == {"ms", "peak_mb"}
