"""attn_implementation="tiled" (attention_core/integrations/transformers.py) on tiny random-weight models of the real
architectures: logits and greedy tokens as transformers' "sdpa" on torch's math backend gives them, every attention
call in the engine (counted) and none in torch's SDPA (spied), packed sequences without an N x N mask, clear refusals,
torch.compile, and the process-wide patch alongside."""
import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")  # pinned in tests/requirements-test.txt

import hf_tiny  # noqa: E402  (tests/support)
import attention_core  # noqa: E402
from attention_core.kernel import counts  # noqa: E402
from attention_core.integrations import transformers as tiled_hf  # noqa: E402  (registers "tiled")


def _engine_calls():
    return counts.calls(tiled_hf.COUNT_KEY)[0]


def _ids(batch=2, length=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :5] = 0  # left padding in the second row
    return ids, mask


@pytest.fixture
def engine_spy(monkeypatch):
    """Every engine call the integration makes: (q length, k length, attn_mask shape or None, dropout_p, k heads)."""
    seen = []
    real = tiled_hf.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        seen.append((q.shape[-2], k.shape[-2], None if attn_mask is None else tuple(attn_mask.shape), dropout_p,
                     k.shape[1], enable_gqa))
        return real(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa, **kw)
    monkeypatch.setattr(tiled_hf, "scaled_dot_product_attention", spy)
    return seen


def _checkout_or_smoke_folder() -> str:
    """The checkout's root (tests/ is in this file's path), else the folder the wheel check copied the tests to."""
    here = os.path.dirname(os.path.abspath(__file__))
    head, sep, _ = here.rpartition(os.sep + "tests")
    return head if sep and os.path.isdir(os.path.join(head, "attention_core")) else here


def test_importing_attention_core_registers_nothing_importing_the_module_registers_tiled():
    code = """
import attention_core, attention_core.integrations
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
assert "tiled" not in AttentionInterface._global_mapping, "registered at import attention_core"
import attention_core.integrations.transformers as t
assert AttentionInterface._global_mapping["tiled"] is t.attention_forward
assert AttentionMaskInterface._global_mapping["tiled"] is t.attention_mask
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=_checkout_or_smoke_folder())
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("arch", hf_tiny.ARCHS)
def test_logits_as_math_sdpa_every_call_in_the_engine(arch, monkeypatch):
    """fp32 logits on "tiled" and on "sdpa" (math) against a float64 math copy: the engine's error within a few
    times torch's own; left padding in the batch; every attention call counted in the engine, none in torch's SDPA."""
    ids, mask = _ids()
    model = hf_tiny.model(arch)
    assert model.config._attn_implementation == "tiled"
    ref64 = copy.deepcopy(model).double()
    ref64.set_attn_implementation("sdpa")
    before = _engine_calls()
    with hf_tiny.torch_sdpa_spy(monkeypatch) as torch_calls:
        out = model(ids, attention_mask=mask).logits
        assert torch_calls[0] == 0, "a 'tiled' model called torch's SDPA"
        assert _engine_calls() - before == hf_tiny.LAYERS
        model.set_attn_implementation("sdpa")
        with hf_tiny.math_sdpa():
            ref32 = model(ids, attention_mask=mask).logits
            ref = ref64(ids, attention_mask=mask).logits
        assert torch_calls[0] > 0, "the spy did not see the 'sdpa' reference"
    keep = mask.bool()
    err, torch_err = ((out.double() - ref)[keep].abs().max().item(), (ref32.double() - ref)[keep].abs().max().item())
    assert err <= 4 * torch_err + 1e-6 * ref.abs().max().item(), (arch, err, torch_err)


@pytest.mark.parametrize("arch", hf_tiny.ARCHS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_tokens_as_math_sdpa_with_both_caches(arch, cache, monkeypatch):
    ids, mask = _ids(length=12)
    model = hf_tiny.model(arch, dtype=torch.float64)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    before = _engine_calls()
    with hf_tiny.torch_sdpa_spy(monkeypatch) as torch_calls:
        got = model.generate(ids, **kw)
        assert torch_calls[0] == 0
    assert _engine_calls() - before == hf_tiny.LAYERS * 12  # one prefill and 11 decode steps
    model.set_attn_implementation("sdpa")
    with hf_tiny.math_sdpa():
        want = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    hf_tiny.model("llama", impl="sdpa").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="tiled")
    assert model.config._attn_implementation == "tiled"
    before = _engine_calls()
    model(_ids()[0])
    assert _engine_calls() - before == hf_tiny.LAYERS
    model.set_attn_implementation("sdpa")
    model(_ids()[0])
    assert _engine_calls() - before == hf_tiny.LAYERS  # switched back: no more engine calls


def test_gqa_runs_without_repeating_key_value_heads(engine_spy):
    hf_tiny.model("llama")(_ids()[0])
    assert engine_spy and all(c[4] == 2 and c[5] for c in engine_spy), engine_spy  # 2 kv heads, enable_gqa


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_packed_sequences_run_per_document_without_a_square_mask(arch, engine_spy, monkeypatch):
    """Three documents in one row (position_ids restarting, as DataCollatorWithFlattening packs them), one longer
    than the sliding window: the logits and the gradients are those of each document run alone, and those of
    "sdpa" (math) on the packed row; no engine call gets a mask over the whole row."""
    lengths = (5, 11, 4)
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model = hf_tiny.model(arch, dtype=torch.float64)
    with hf_tiny.torch_sdpa_spy(monkeypatch) as torch_calls:
        out = model(ids, position_ids=pos, use_cache=False).logits
        assert torch_calls[0] == 0
    cuts = [0, 5, 16, 20]
    alone = torch.cat([model(ids[:, a:b], use_cache=False).logits for a, b in zip(cuts, cuts[1:])], dim=1)
    torch.testing.assert_close(out, alone, rtol=1e-9, atol=1e-9)
    if not tiled_hf._marks_packing():
        pytest.skip(f"not applicable: transformers {transformers.__version__} on torch {torch.__version__} does not "
                    "mark packed rows (its 'sdpa' attends across documents, its sliding masks are N x N): the "
                    "documents were checked above; test_packed_rows_found_where_transformers_does_not_mark_them")
    n = ids.shape[1]
    assert engine_spy and all(c[0] < n and (c[2] is None or c[2][-1] < n) for c in engine_spy[:4]), engine_spy
    assert sorted({c[0] for c in engine_spy}) == sorted(set(lengths))
    model.set_attn_implementation("sdpa")
    with hf_tiny.math_sdpa():
        ref = model(ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_packed_sequences_from_flash_kwargs_of_the_collator(engine_spy):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) also passes cu_seq_lens_q: the documents come
    from there."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batch = collator([{"input_ids": list(range(1, 7))}, {"input_ids": list(range(10, 19))}])
    model = hf_tiny.model("llama", dtype=torch.float64)
    kw = {k: v for k, v in batch.items() if k not in ("labels",)}
    out = model(**kw, use_cache=False).logits
    assert sorted(c[0] for c in engine_spy) == [6, 6, 9, 9]
    alone = torch.cat([model(batch["input_ids"][:, :6]).logits, model(batch["input_ids"][:, 6:]).logits], dim=1)
    torch.testing.assert_close(out, alone, rtol=1e-9, atol=1e-9)
    # cu_seq_lens_q alone (positions running on across the documents): still one call per document per layer, and
    # the same logits (RoPE makes attention depend on relative positions only)
    engine_spy.clear()
    kw.pop("position_ids")
    out = model(**kw, use_cache=False).logits
    assert sorted(c[0] for c in engine_spy) == [6, 6, 9, 9]
    torch.testing.assert_close(out, alone, rtol=1e-7, atol=1e-7)


def test_dropout_in_training_reaches_the_engine(engine_spy):
    model = hf_tiny.model("qwen2", attention_dropout=0.5).train()
    ids = _ids()[0]
    a, b = model(ids).logits, model(ids).logits
    assert not torch.equal(a, b), "training with attention dropout gave the same logits twice"
    assert all(c[3] == 0.5 for c in engine_spy)
    a.sum().backward()
    model.eval()
    engine_spy.clear()
    torch.testing.assert_close(model(ids).logits, model(ids).logits)
    assert all(c[3] == 0.0 for c in engine_spy)


def test_soft_capping_refused_naming_eager():
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    attn_logit_softcapping=50.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="tiled")
    with pytest.raises(ValueError, match="soft-capping.*attn_implementation='eager'"):
        model(_ids()[0])


def test_output_attentions_refused_naming_eager():
    model = hf_tiny.model("llama")
    with pytest.raises(ValueError, match="output_attentions.*attn_implementation='eager'"):
        model(_ids()[0], output_attentions=True)


def test_an_old_transformers_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(tiled_hf, "_version", lambda module: "4.52.4")
    with pytest.raises(ImportError, match=r"transformers 4\.52\.4 .*>= 4\.56"):
        tiled_hf.register()


def test_torch_compile_of_a_tiled_model():
    """Compiled (aot_eager: no C++ toolchain needed), the model gives eager's logits and its attention calls run in
    the compiled graph (counted as compiled)."""
    torch._dynamo.reset()
    model = hf_tiny.model("qwen2")
    ids = _ids(batch=1)[0]
    want = model(ids, use_cache=False).logits
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    before = counts.calls(tiled_hf.COUNT_KEY)[1]
    got = compiled(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counts.calls(tiled_hf.COUNT_KEY)[1] - before == hf_tiny.LAYERS
    pos = torch.cat([torch.arange(9), torch.arange(11)]).unsqueeze(0)  # packed: two documents
    torch.testing.assert_close(compiled(ids, position_ids=pos, use_cache=False).logits,
                               model(ids, position_ids=pos, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_process_wide_patch_and_tiled_together_never_route_twice(monkeypatch):
    """enable(force=True) beside a "tiled" model: the tiled model's calls go to the engine once each (its own
    count), the patch sees none of them; an "sdpa" model in the same process is the patch's (routed there)."""
    tiled, plain = hf_tiny.model("llama"), hf_tiny.model("llama", impl="sdpa")
    ids = _ids()[0]
    attention_core.patch.reset_stats()
    attention_core.enable(force=True)
    try:
        before = _engine_calls()
        tiled(ids)
        assert _engine_calls() - before == hf_tiny.LAYERS
        assert attention_core.patch.stats().get("torch_sdpa", {}).get("total", 0) == 0
        plain(ids)
        assert attention_core.patch.stats()["torch_sdpa"]["routed"] == hf_tiny.LAYERS
        assert _engine_calls() - before == hf_tiny.LAYERS
    finally:
        attention_core.disable()
        attention_core.patch.reset_stats()


def test_document_bounds_read_once_per_tensor_and_again_when_it_changes():
    """The layers of one forward share the position_ids tensor: its documents are read once; a tensor changed in
    place, another batch size or an inference-mode tensor (no version counter) is read anew."""
    pos = torch.cat([torch.arange(3), torch.arange(4)]).unsqueeze(0)
    assert tiled_hf._document_bounds(pos, None, 1, 7) == [[(0, 3), (3, 7)]]
    assert tiled_hf._document_bounds(pos, None, 2, 7) == [[(0, 3), (3, 7)]] * 2
    pos[0, 3] = 3  # one document of 4, then one of 3
    assert tiled_hf._document_bounds(pos, None, 2, 7) == [[(0, 4), (4, 7)]] * 2
    with torch.inference_mode():
        frozen = torch.cat([torch.arange(2), torch.arange(5)]).unsqueeze(0)
        assert tiled_hf._document_bounds(frozen, None, 1, 7) == [[(0, 2), (2, 7)]]
    assert tiled_hf._document_bounds(None, torch.tensor([0, 2, 7]), 1, 7) == [[(0, 2), (2, 7)]]
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        tiled_hf._document_bounds(None, torch.tensor([0, 2, 6]), 1, 7)


def test_packed_rows_found_where_transformers_does_not_mark_them(monkeypatch):
    """transformers 4.5x on torch < 2.6 never marks packed rows (simulated here: its packed-row finder finds none):
    "tiled" finds the documents from position_ids itself, eager and compiled, with and without a sliding mask."""
    from transformers import masking_utils
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    monkeypatch.setattr(tiled_hf, "_marks_packing", lambda: False)
    lengths = (5, 11, 4)
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model = hf_tiny.model("qwen2", dtype=torch.float64)  # layer 2 slides (window 8 < 11): a mask from transformers
    cuts = [0, 5, 16, 20]
    alone = torch.cat([model(ids[:, a:b], use_cache=False).logits for a, b in zip(cuts, cuts[1:])], dim=1)
    torch.testing.assert_close(model(ids, position_ids=pos, use_cache=False).logits, alone, rtol=1e-9, atol=1e-9)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(ids, position_ids=pos, use_cache=False).logits, alone, rtol=1e-7, atol=1e-7)
    torch._dynamo.reset()
