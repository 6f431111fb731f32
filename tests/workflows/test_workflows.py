"""The bundled workflows (workflows/*.json), the workflows saved before the V3 nodes (saved_before_v3/), the
UI->API converter and the validator.

Node schemas are the live /object_info of a real ComfyUI 0.33.0 and 0.3.75 server with this pack installed (one
start per version per session, live_schema.py); the saved /object_info in ../shared/comfyui (plus the pack's
schemas built from its classes) only when no server can start, which fails under CI=true.
"""

import ast
import copy
import glob
import http.server
import json
import os
import re
import subprocess
import sys
import threading

import pytest

import live_schema
import workflow_schema as ws
from comfy_harness import missing

wapi = ws.wapi
ROOT = ws.ROOT
WORKFLOW_API_PATH = os.path.join(ROOT, "tools", "workflow_api.py")
WORKFLOW_DIR = os.path.join(ROOT, "workflows")
WORKFLOWS = sorted(glob.glob(os.path.join(WORKFLOW_DIR, "*.json")))
IDS = [os.path.basename(p) for p in WORKFLOWS]
EXPECTED_WORKFLOWS = {
    "Wan 2.2 5B Text to Video 480p.json",
    "Wan 2.2 5B Text to Video 720p.json",
    "Wan 2.2 5B Image to Video 480p.json",
    "LTX-2.3 Text to Video 720p.json",
    "LTX-2.3 Image to Video 720p.json",
    "LTX-2.3 Text to Video 1080p.json",
    "Wan 2.2 14B Text to Video 480p.json",
    "Wan 2.2 14B Image to Video 480p.json",
    "Z-Image Turbo Image 1024x1024.json",
    "Z-Image Turbo Image 1536x1536.json",
}
WAN_WORKFLOWS = sorted(p for p in WORKFLOWS if os.path.basename(p).startswith("Wan "))

# (node type, input) -> models folder the file must be put in
LOADER_FOLDERS = {key: folder + "/" for key, folder in ws.LOADER_FOLDERS.items()}
SAMPLING_MODEL_CONSUMERS = {"KSampler", "KSamplerAdvanced", "SamplerCustom", "CFGGuider", "BasicGuider",
                            "DualCFGGuider", "PerpNegGuider"}
MODEL_FILE_RE = re.compile(r"\.(safetensors|sft|ckpt|pt|pth|bin|gguf)$", re.IGNORECASE)
LAUNCH_FLAGS = ("--lowvram", "--reserve-vram", "--disable-pinned-memory", "--cpu-vae")


@pytest.fixture(scope="module")
def oi_new():
    return live_schema.object_info_or_skip("0.33.0")[0]


@pytest.fixture(scope="module")
def oi_old():
    return live_schema.object_info_or_skip("0.3.75")[0]


@pytest.fixture(scope="module")
def pack_types_new(oi_new):
    return live_schema.object_info_or_skip("0.33.0")[2]


def stock_only(info, pack_types):
    return {k: v for k, v in info.items() if k not in pack_types}


def load(path):
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def load_named(name):
    return load(os.path.join(WORKFLOW_DIR, name))


def real_types(wf):
    return {n["type"] for n in wf["nodes"] if n["type"] not in ws.FRONTEND_ONLY_TYPES}


def by_type(wf, ntype):
    return [n for n in wf["nodes"] if n["type"] == ntype]


def note_text(wf):
    return "\n".join(n["widgets_values"][0] for n in wf["nodes"] if n["type"] in ws.NOTE_TYPES)


# --------------------------------------------------------------------------
# the bundled workflows
# --------------------------------------------------------------------------

def test_expected_workflows_present():
    assert EXPECTED_WORKFLOWS <= set(IDS), f"missing: {sorted(EXPECTED_WORKFLOWS - set(IDS))}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_ui_format_shape(path):
    wf = load(path)
    for key in ("last_node_id", "last_link_id", "nodes", "links", "groups", "config", "extra", "version"):
        assert key in wf, key
    assert "ds" in wf["extra"]
    assert wf["last_node_id"] == max(n["id"] for n in wf["nodes"])
    assert wf["last_link_id"] == max(l[0] for l in wf["links"])
    for n in wf["nodes"]:
        for key in ("id", "type", "pos", "size", "flags", "order", "mode", "properties"):
            assert key in n, (n.get("id"), key)
        assert n["mode"] == 0, f"node {n['id']} ({n['type']}) is muted or bypassed"


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_valid_against_comfyui_0_33_0(path, oi_new):
    assert ws.validate_workflow(load(path), oi_new) == []


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_valid_against_comfyui_0_3_75(path, oi_old):
    wf = load(path)
    missing = real_types(wf) - set(oi_old)
    if missing:
        pytest.skip(f"not applicable: uses node types stock ComfyUI 0.3.75 does not have: {sorted(missing)}")
    assert ws.validate_workflow(wf, oi_old) == []


def test_wan_workflows_need_nothing_newer_than_0_3_75(oi_old):
    assert WAN_WORKFLOWS
    for path in WAN_WORKFLOWS:
        assert real_types(load(path)) <= set(oi_old), path


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_only_core_and_pack_nodes(path, oi_new, pack_types_new):
    raw = stock_only(oi_new, pack_types_new)
    for ntype in real_types(load(path)):
        assert ntype in raw or ntype in pack_types_new, ntype
        if ntype in raw:
            assert not raw[ntype].get("api_node"), f"{ntype} is an API (paid) node"


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_note_lists_files_sources_flags_memory(path, oi_new):
    wf = load(path)
    text = note_text(wf)
    assert text, "no Note/MarkdownNote node"
    for node in wf["nodes"]:
        if node["type"] not in oi_new:
            continue
        values, _slots, _extra = wapi.map_widget_values(node.get("widgets_values"), oi_new[node["type"]])
        for name, value in values.items():
            if isinstance(value, str) and MODEL_FILE_RE.search(value):
                key = (node["type"], name)
                assert key in LOADER_FOLDERS, f"loader input {key} has no known models folder in this test"
                assert value in text, f"note does not name {value}"
                assert LOADER_FOLDERS[key] in text, f"note does not name the folder {LOADER_FOLDERS[key]}"
    assert "https://huggingface.co/" in text
    if os.path.basename(path).startswith("Wan "):
        assert "Comfy-Org/Wan_2.2_ComfyUI_Repackaged" in text
    elif os.path.basename(path).startswith("Z-Image "):
        assert "Comfy-Org/z_image_turbo" in text
    else:
        assert "Lightricks/LTX-2.3" in text
        assert "64 GB" in text, "LTX notes must state the system RAM needed"
    for flag in LAUNCH_FLAGS:
        assert flag in text, flag
    assert re.search(r"\d+(\.\d+)?\s*GB", text), "no memory figure"
    assert re.search(r"\b\d+:\d\d\b|not measured", text, re.IGNORECASE), "no time (or an explicit 'not measured')"
    assert "32 GB" in text and "16 GB" in text, "tiled VAE decode sizes for 32 GB and 16 GB cards"
    assert "fp16" in text and "bf16" in text, "fp16 advice for GPUs without bf16"


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_tiled_attention_on_the_sampled_model_path(path):
    wf = load(path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = wapi.parse_links(wf)

    def patched(node_id, trail=()):
        node = nodes[node_id]
        if node["type"] == "TiledAttentionPatch" and node.get("mode", 0) == 0:
            return True
        ups = [i for i in node.get("inputs") or []
               if i.get("link") is not None and i.get("type") in ("MODEL", "*")]
        if not ups:
            return False  # reached the loader without passing the patch
        assert node_id not in trail, "cycle"
        return all(patched(links[i["link"]][0], trail + (node_id,)) for i in ups)

    consumers = [n for n in wf["nodes"] if n["type"] in SAMPLING_MODEL_CONSUMERS]
    assert consumers, "no sampler/guider found"
    for n in consumers:
        model_in = [i for i in n["inputs"] if i["name"] == "model"]
        assert model_in and model_in[0]["link"] is not None, f"node {n['id']} ({n['type']}) has no model link"
        assert patched(links[model_in[0]["link"]][0]), \
            f"node {n['id']} ({n['type']}): the MODEL it samples does not pass through TiledAttentionPatch"


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_converter_makes_a_well_formed_prompt(path, oi_new):
    wf = load(path)
    prompt = wapi.workflow_to_prompt(wf, oi_new)
    expected_ids = {str(n["id"]) for n in wf["nodes"]
                    if n["type"] not in ws.FRONTEND_ONLY_TYPES and n.get("mode", 0) == 0}
    assert set(prompt) == expected_ids
    assert "TiledAttentionPatch" in {e["class_type"] for e in prompt.values()}
    for nid, entry in prompt.items():
        assert set(entry) >= {"class_type", "inputs"}
        assert entry["class_type"] in oi_new
        node_def = oi_new[entry["class_type"]]
        for name, v in entry["inputs"].items():
            assert name not in ("control_after_generate", "upload"), (nid, name)
            if isinstance(v, list):
                assert len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int), (nid, name, v)
                assert v[0] in prompt, (nid, name, v)
                assert 0 <= v[1] < len(oi_new[prompt[v[0]]["class_type"]]["output"]), (nid, name, v)
        for name, spec, _section in wapi.iter_inputs(node_def, sections=("required",)):
            assert name in entry["inputs"], f"{nid} ({entry['class_type']}) lacks required input {name}"
    json.dumps(prompt)


@pytest.mark.parametrize("path", WAN_WORKFLOWS, ids=[os.path.basename(p) for p in WAN_WORKFLOWS])
def test_converter_follows_the_server_version(path, oi_new, oi_old):
    wf = load(path)
    new = wapi.workflow_to_prompt(wf, oi_new)
    old = wapi.workflow_to_prompt(wf, oi_old)
    save_new = [e["inputs"] for e in new.values() if e["class_type"] == "SaveVideo"][0]
    save_old = [e["inputs"] for e in old.values() if e["class_type"] == "SaveVideo"][0]
    # 0.33.0: format is a dynamic combo with a nested codec; 0.3.75: two plain combos.
    assert save_new["format"] == "auto" and save_new["format.codec"] == "auto" and "codec" not in save_new
    assert save_old["format"] == "auto" and save_old["codec"] == "auto"


def test_converter_values_wan_480p(oi_new):
    wf = load_named("Wan 2.2 5B Text to Video 480p.json")
    prompt = wapi.workflow_to_prompt(wf, oi_new)
    by_class = {}
    for nid, e in prompt.items():
        by_class.setdefault(e["class_type"], []).append((nid, e["inputs"]))
    (ks_id, ks), = by_class["KSampler"]
    assert {k: v for k, v in ks.items() if not isinstance(v, list)} == {
        "seed": 42, "steps": 20, "cfg": 5.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0}
    (_, msd3), = by_class["ModelSamplingSD3"]
    assert ks["model"][0] == [nid for nid, _ in by_class["ModelSamplingSD3"]][0] and msd3["shift"] == 8.0
    (_, patch), = by_class["TiledAttentionPatch"]
    assert {k: v for k, v in patch.items() if k != "model"} == {
        "mode": "auto", "memory_budget_mb": 0, "half_precision": "keep", "min_tokens": 1024}
    (_, clip), = by_class["CLIPLoader"]
    assert clip == {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "cpu"}
    (_, lat), = by_class["Wan22ImageToVideoLatent"]
    assert (lat["width"], lat["height"], lat["length"], lat["batch_size"]) == (832, 480, 41, 1)
    assert "start_image" not in lat
    (_, cv), = by_class["CreateVideo"]
    assert cv["fps"] == 24.0


def test_converter_values_ltx_720p(oi_new):
    wf = load_named("LTX-2.3 Text to Video 720p.json")
    prompt = wapi.workflow_to_prompt(wf, oi_new)
    classes = [e["class_type"] for e in prompt.values()]
    assert classes.count("SamplerCustomAdvanced") == 2
    te = [e["inputs"] for e in prompt.values() if e["class_type"] == "LTXAVTextEncoderLoader"][0]
    assert te["device"] == "cpu"
    ev = [e["inputs"] for e in prompt.values() if e["class_type"] == "EmptyLTXVLatentVideo"][0]
    assert (ev["width"] * 2, ev["height"] * 2) == (1280, 704) and (ev["length"] - 1) % 8 == 0
    au = [e["inputs"] for e in prompt.values() if e["class_type"] == "LTXVEmptyLatentAudio"][0]
    assert au["frames_number"] == ev["length"] and au["frame_rate"] == 25.0
    noise = [e["inputs"] for e in prompt.values() if e["class_type"] == "RandomNoise"]
    assert all(n == {"noise_seed": 42} for n in noise)


# --------------------------------------------------------------------------
# converter on hand-made graphs
# --------------------------------------------------------------------------

def _graph():
    """Checkpoint -> Reroute -> (bypassed LoRA) -> KSampler, PrimitiveNode -> steps, muted negative, a Note."""
    return {
        "last_node_id": 9, "last_link_id": 9,
        "nodes": [
            {"id": 1, "type": "CheckpointLoaderSimple", "mode": 0, "order": 0, "inputs": [],
             "outputs": [{"name": "MODEL", "type": "MODEL", "links": [1]},
                         {"name": "CLIP", "type": "CLIP", "links": [2, 9]},
                         {"name": "VAE", "type": "VAE", "links": []}],
             "widgets_values": ["sd.safetensors"]},
            {"id": 2, "type": "Reroute", "mode": 0, "order": 1,
             "inputs": [{"name": "", "type": "*", "link": 1}],
             "outputs": [{"name": "", "type": "MODEL", "links": [3]}]},
            {"id": 3, "type": "LoraLoaderModelOnly", "mode": 4, "order": 2,
             "inputs": [{"name": "model", "type": "MODEL", "link": 3}],
             "outputs": [{"name": "MODEL", "type": "MODEL", "links": [4]}],
             "widgets_values": ["lora.safetensors", 1.0]},
            {"id": 4, "type": "KSampler", "mode": 0, "order": 6,
             "inputs": [{"name": "model", "type": "MODEL", "link": 4},
                        {"name": "positive", "type": "CONDITIONING", "link": 5},
                        {"name": "negative", "type": "CONDITIONING", "link": 6},
                        {"name": "latent_image", "type": "LATENT", "link": 7},
                        {"name": "steps", "type": "INT", "widget": {"name": "steps"}, "link": 8}],
             "outputs": [{"name": "LATENT", "type": "LATENT", "links": []}],
             "widgets_values": [7, "randomize", 20, 8.0, "euler", "normal", 1.0]},
            {"id": 5, "type": "CLIPTextEncode", "mode": 0, "order": 3,
             "inputs": [{"name": "clip", "type": "CLIP", "link": 2}],
             "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [5]}],
             "widgets_values": ["a cat"]},
            {"id": 6, "type": "CLIPTextEncode", "mode": 2, "order": 4,
             "inputs": [{"name": "clip", "type": "CLIP", "link": 9}],
             "outputs": [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [6]}],
             "widgets_values": ["muted"]},
            {"id": 7, "type": "EmptyLatentImage", "mode": 0, "order": 5, "inputs": [],
             "outputs": [{"name": "LATENT", "type": "LATENT", "links": [7]}],
             "widgets_values": [512, 768, 1]},
            {"id": 8, "type": "PrimitiveNode", "mode": 0, "order": 0, "inputs": [],
             "outputs": [{"name": "INT", "type": "INT", "links": [8], "widget": {"name": "steps"}}],
             "widgets_values": [33, "fixed"]},
            {"id": 9, "type": "Note", "mode": 0, "order": 0, "inputs": [], "outputs": [],
             "widgets_values": ["hello"]},
        ],
        "links": [[1, 1, 0, 2, 0, "MODEL"], [2, 1, 1, 5, 0, "CLIP"], [3, 2, 0, 3, 0, "MODEL"],
                  [4, 3, 0, 4, 0, "MODEL"], [5, 5, 0, 4, 1, "CONDITIONING"], [6, 6, 0, 4, 2, "CONDITIONING"],
                  [7, 7, 0, 4, 3, "LATENT"], [8, 8, 0, 4, 4, "INT"], [9, 1, 1, 6, 0, "CLIP"]],
        "groups": [], "config": {}, "extra": {}, "version": 0.4,
    }


def test_converter_resolves_frontend_only_bypassed_and_muted_nodes(oi_new):
    prompt = wapi.workflow_to_prompt(_graph(), oi_new)
    assert set(prompt) == {"1", "4", "5", "7"}  # no Reroute, bypassed LoRA, muted encoder, Primitive, Note
    ks = prompt["4"]
    assert ks["class_type"] == "KSampler"
    assert ks["inputs"] == {"seed": 7, "steps": 33, "cfg": 8.0, "sampler_name": "euler", "scheduler": "normal",
                            "denoise": 1.0, "model": ["1", 0], "positive": ["5", 0], "latent_image": ["7", 0]}
    assert prompt["7"]["inputs"] == {"width": 512, "height": 768, "batch_size": 1}
    assert prompt["5"]["inputs"] == {"text": "a cat", "clip": ["1", 1]}


def test_converter_rejects_unknown_types_and_subgraphs(oi_new):
    g = _graph()
    g["nodes"][6]["type"] = "NoSuchNode"
    with pytest.raises(ValueError, match="NoSuchNode"):
        wapi.workflow_to_prompt(g, oi_new)
    g = _graph()
    g["nodes"][6]["type"] = "0b1f7f3e-0000-4000-8000-000000000000"
    g["definitions"] = {"subgraphs": [{"id": "0b1f7f3e-0000-4000-8000-000000000000"}]}
    with pytest.raises(ValueError, match="subgraph"):
        wapi.workflow_to_prompt(g, oi_new)


def test_widget_mapping_control_after_generate_variants(oi_new, oi_old):
    ks = oi_new["KSampler"]  # seed: control_after_generate true
    values, _slots, extra = wapi.map_widget_values([5, "fixed", 20, 8.0, "euler", "normal", 1.0], ks)
    assert values["seed"] == 5 and values["steps"] == 20 and extra == []
    # a save without the control value still lines up
    values, _slots, extra = wapi.map_widget_values([5, 20, 8.0, "euler", "normal", 1.0], ks)
    assert values["steps"] == 20 and values["denoise"] == 1.0 and extra == []
    # 0.33.0 marks it with a string ("fixed"), 0.3.75 with true
    assert oi_new["PrimitiveInt"]["input"]["required"]["value"][1]["control_after_generate"] == "fixed"
    assert oi_old["PrimitiveInt"]["input"]["required"]["value"][1]["control_after_generate"] is True
    for oi in (oi_new, oi_old):
        values, _slots, extra = wapi.map_widget_values([121, "fixed"], oi["PrimitiveInt"])
        assert values == {"value": 121} and extra == []
    # INT named seed without the option: the frontend still adds the control widget
    seed_only = {"input": {"required": {"seed": ["INT", {"default": 0}], "n": ["INT", {}]}}}
    values, _s, extra = wapi.map_widget_values([3, "increment", 4], seed_only)
    assert values == {"seed": 3, "n": 4} and extra == []
    # ... unless the option says false
    no_control = {"input": {"required": {"seed": ["INT", {"control_after_generate": False}],
                                         "mode": [["fixed", "other"], {}]}}}
    values, _s, extra = wapi.map_widget_values([3, "fixed"], no_control)
    assert values == {"seed": 3, "mode": "fixed"} and extra == []
    # a combo with control_after_generate
    combo = {"input": {"required": {"pick": [["a", "b"], {"control_after_generate": True}], "x": ["FLOAT", {}]}}}
    values, _s, extra = wapi.map_widget_values(["b", "randomize", 0.5], combo)
    assert values == {"pick": "b", "x": 0.5} and extra == []


def test_widget_mapping_upload_dynamic_combo_multitype_and_dict(oi_new, oi_old):
    values, _s, extra = wapi.map_widget_values(["example.png", "image"], oi_new["LoadImage"])
    assert values == {"image": "example.png"} and extra == []
    values, _s, extra = wapi.map_widget_values(["video/x", "auto", "auto"], oi_new["SaveVideo"])
    assert values == {"filename_prefix": "video/x", "format": "auto", "format.codec": "auto"} and extra == []
    values, _s, extra = wapi.map_widget_values(["video/x", "auto", "auto"], oi_old["SaveVideo"])
    assert values == {"filename_prefix": "video/x", "format": "auto", "codec": "auto"} and extra == []
    values, _s, extra = wapi.map_widget_values(["video/x", "mp4", "h264", "re-encode", 20.0, "sRGB"],
                                               oi_new["SaveVideo"])
    assert values == {"filename_prefix": "video/x", "format": "mp4", "format.codec": "h264",
                      "format.codec.encoding": "re-encode", "format.codec.encoding.crf": 20.0,
                      "format.codec.encoding.color_space": "sRGB"} and extra == []
    values, _s, extra = wapi.map_widget_values([97, 25, 1], oi_new["LTXVEmptyLatentAudio"])  # "FLOAT,INT"
    assert values == {"frames_number": 97, "frame_rate": 25, "batch_size": 1} and extra == []
    values, _s, extra = wapi.map_widget_values({"width": 64, "height": 32, "bogus": 1}, oi_new["EmptyLatentImage"])
    assert values == {"width": 64, "height": 32} and extra == ["bogus"]


def test_converter_wraps_list_values(oi_new):
    oi = {"ListNode": {"input": {"required": {"items": ["STRING", {}]}}, "output": [], "output_name": []}}
    wf = {"nodes": [{"id": 1, "type": "ListNode", "mode": 0, "inputs": [], "outputs": [],
                     "widgets_values": [["a", "b"]]}], "links": []}
    assert wapi.workflow_to_prompt(wf, oi)["1"]["inputs"] == {"items": {"__value__": ["a", "b"]}}


# --------------------------------------------------------------------------
# converter as a stdlib-only script
# --------------------------------------------------------------------------

def test_converter_imports_only_the_stdlib():
    tree = ast.parse(open(WORKFLOW_API_PATH, encoding="utf-8").read())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports: the file must run as a plain script"
            mods.add(node.module)
    assert mods <= {"argparse", "json", "os", "sys", "urllib.error", "urllib.parse", "urllib.request"}, mods


def _merged_object_info_file(tmp_path, oi_new):
    path = tmp_path / "object_info.json"
    path.write_text(json.dumps(oi_new))
    return path


def test_cli_prints_the_prompt(tmp_path, oi_new):
    wf_path = os.path.join(WORKFLOW_DIR, "Wan 2.2 5B Image to Video 480p.json")
    oi_path = _merged_object_info_file(tmp_path, oi_new)
    out = subprocess.run([sys.executable, WORKFLOW_API_PATH, wf_path, "--object-info", str(oi_path)],
                         capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == wapi.workflow_to_prompt(load(wf_path), oi_new)


def test_cli_reports_types_missing_from_object_info(tmp_path, oi_new, pack_types_new):
    # the live schemas without this pack's nodes (a ComfyUI where the pack is not installed); no ../shared needed
    stock = tmp_path / "object_info_stock.json"
    stock.write_text(json.dumps(stock_only(oi_new, pack_types_new)))
    wf_path = os.path.join(WORKFLOW_DIR, "Wan 2.2 5B Text to Video 480p.json")
    out = subprocess.run([sys.executable, WORKFLOW_API_PATH, wf_path, "--object-info", str(stock)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "TiledAttentionPatch" in out.stderr


def test_cli_queues_against_a_server(oi_new):
    wf_path = os.path.join(WORKFLOW_DIR, "LTX-2.3 Text to Video 720p.json")
    received = {}
    object_info = json.dumps(oi_new).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body, code=200):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/object_info":
                self._send(object_info)
            else:
                self._send(b"{}", 404)

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            received[self.path] = json.loads(self.rfile.read(n))
            self._send(json.dumps({"prompt_id": "abc-123", "number": 0, "node_errors": {}}).encode())

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = subprocess.run([sys.executable, WORKFLOW_API_PATH, wf_path, "--server", url, "--queue"],
                             capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr
    assert "abc-123" in out.stdout
    body = received["/prompt"]
    wf = load(wf_path)
    assert body["prompt"] == wapi.workflow_to_prompt(wf, oi_new)
    assert body["extra_data"]["extra_pnginfo"]["workflow"] == wf


# --------------------------------------------------------------------------
# the validator catches broken copies
# --------------------------------------------------------------------------

def _one(wf, ntype):
    (node,) = by_type(wf, ntype)
    return node


def _input_link(wf, node, name):
    (inp,) = [i for i in node["inputs"] if i["name"] == name]
    return inp


def _has(problems, *parts):
    return any(all(p in msg for p in parts) for msg in problems)


@pytest.fixture
def wan(oi_new):
    return copy.deepcopy(load_named("Wan 2.2 5B Text to Video 480p.json"))


def test_broken_wrong_link_type(wan, oi_new):
    ks, vae, msd3 = _one(wan, "KSampler"), _one(wan, "VAELoader"), _one(wan, "ModelSamplingSD3")
    lid = _input_link(wan, ks, "model")["link"]
    link = [l for l in wan["links"] if l[0] == lid][0]
    link[1], link[2], link[5] = vae["id"], 0, "VAE"
    msd3["outputs"][0]["links"].remove(lid)
    vae["outputs"][0]["links"].append(lid)
    problems = ws.validate_workflow(wan, oi_new)
    assert _has(problems, f"node {ks['id']} (KSampler) input 'model'", "'VAE'", "'MODEL'"), problems


def test_broken_unknown_node(wan, oi_new):
    msd3 = _one(wan, "ModelSamplingSD3")
    msd3["type"] = "ModelSamplingNoSuchThing"
    problems = ws.validate_workflow(wan, oi_new)
    assert _has(problems, f"node {msd3['id']} (ModelSamplingNoSuchThing)", "unknown node type"), problems


def test_broken_bad_combo_value(wan, oi_new):
    ks = _one(wan, "KSampler")
    ks["widgets_values"][4] = "not_a_sampler"
    patch = _one(wan, "TiledAttentionPatch")
    patch["widgets_values"][0] = "fast"
    problems = ws.validate_workflow(wan, oi_new)
    assert _has(problems, f"node {ks['id']} (KSampler) input 'sampler_name'", "not_a_sampler"), problems
    assert _has(problems, f"node {patch['id']} (TiledAttentionPatch) input 'mode'", "'fast'"), problems


def test_broken_missing_required_input(wan, oi_new):
    ks = _one(wan, "KSampler")
    inp = _input_link(wan, ks, "positive")
    lid, inp["link"] = inp["link"], None
    wan["links"] = [l for l in wan["links"] if l[0] != lid]
    for n in wan["nodes"]:
        for o in n.get("outputs") or []:
            if lid in (o.get("links") or []):
                o["links"].remove(lid)
    problems = ws.validate_workflow(wan, oi_new)
    assert _has(problems, f"node {ks['id']} (KSampler) input 'positive'", "not connected"), problems


def test_broken_missing_required_widget_and_extra_values(wan, oi_new):
    ks = _one(wan, "KSampler")
    ks["widgets_values"] = ks["widgets_values"][:3]  # seed, control, steps
    msd3 = _one(wan, "ModelSamplingSD3")
    msd3["widgets_values"].append(3)
    problems = ws.validate_workflow(wan, oi_new)
    assert _has(problems, f"node {ks['id']} (KSampler) input 'cfg'", "no value"), problems
    assert _has(problems, f"node {msd3['id']} (ModelSamplingSD3)", "unexpected widget value"), problems


def test_broken_out_of_range_and_wrong_type_values(wan, oi_new):
    ks = _one(wan, "KSampler")
    ks["widgets_values"][2] = 0  # steps, min 1
    ffn = _one(wan, "TiledFFNChunking")
    ffn["widgets_values"] = [0, "yes"]
    problems = ws.validate_workflow(wan, oi_new)
    assert _has(problems, f"node {ks['id']} (KSampler) input 'steps'", "minimum"), problems
    assert _has(problems, f"node {ffn['id']} (TiledFFNChunking) input 'enabled'", "BOOLEAN"), problems


def test_broken_link_table(wan, oi_new):
    ks = _one(wan, "KSampler")
    lid = _input_link(wan, ks, "latent_image")["link"]
    link = [l for l in wan["links"] if l[0] == lid][0]
    link[4] = 0
    problems = ws.validate_workflow(wan, oi_new)
    assert _has(problems, f"node {ks['id']} (KSampler)", f"link {lid}"), problems


def test_model_files_are_only_checked_on_request(wan, oi_new):
    assert ws.validate_workflow(wan, oi_new) == []
    problems = ws.validate_workflow(wan, oi_new, ignore_model_files=False)
    unet, clip, vae = _one(wan, "UNETLoader"), _one(wan, "CLIPLoader"), _one(wan, "VAELoader")
    assert _has(problems, f"node {unet['id']} (UNETLoader) input 'unet_name'"), problems
    assert _has(problems, f"node {clip['id']} (CLIPLoader) input 'clip_name'"), problems
    assert _has(problems, f"node {vae['id']} (VAELoader) input 'vae_name'"), problems
    assert not _has(problems, "sampler_name")


def test_pack_nodes_must_be_present_and_known(wan, oi_new, pack_types_new):
    problems = ws.validate_workflow(wan, stock_only(oi_new, pack_types_new))
    patch = _one(wan, "TiledAttentionPatch")
    assert _has(problems, f"node {patch['id']} (TiledAttentionPatch)", "unknown node type"), problems
    assert _has(problems, "TiledAttentionPatch", "not in object_info"), problems
    problems = ws.validate_workflow(wan, oi_new, require_pack_nodes=("TiledAttentionInfo",))
    assert _has(problems, "no active TiledAttentionInfo node"), problems


def test_ltx_broken_copy(oi_new):
    wf = copy.deepcopy(load_named("LTX-2.3 Text to Video 720p.json"))
    adec = _one(wf, "LTXVAudioVAEDecode")
    # feed the video VAE (checkpoint output 2) into the audio decoder's LATENT input
    lid = _input_link(wf, adec, "samples")["link"]
    link = [l for l in wf["links"] if l[0] == lid][0]
    ckpt = _one(wf, "CheckpointLoaderSimple")
    for n in wf["nodes"]:
        if n["id"] == link[1]:
            n["outputs"][link[2]]["links"].remove(lid)
    link[1], link[2], link[5] = ckpt["id"], 2, "VAE"
    ckpt["outputs"][2]["links"].append(lid)
    problems = ws.validate_workflow(wf, oi_new)
    assert _has(problems, f"node {adec['id']} (LTXVAudioVAEDecode) input 'samples'", "'VAE'", "'LATENT'"), problems


# --------------------------------------------------------------------------
# the pack's live schema, the text encoder and VAE paths, and workflows saved before the V3 nodes
# --------------------------------------------------------------------------

OLD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "saved_before_v3")
OLD_WORKFLOWS = sorted(glob.glob(os.path.join(OLD_DIR, "*.json")))
OLD_IDS = [os.path.basename(p) for p in OLD_WORKFLOWS]
PACK_NODES = {"TiledAttentionPatch", "TiledAttentionPatchCLIP", "TiledAttentionPatchVAE", "TiledFFNChunking",
              "TiledAttentionInfo", "TiledAttentionFit", "TiledAttentionEverywhere"}


@pytest.mark.parametrize("version", ["0.33.0", "0.3.75"])
def test_live_schema_has_the_pack_nodes_with_tooltips(version):
    info, source, pack_types = live_schema.object_info_or_skip(version)
    assert pack_types == PACK_NODES, (source, sorted(pack_types))
    if source == "live":  # ComfyUI's loader imported the pack from a folder named tiled-attention
        assert all(info[t]["python_module"] == "custom_nodes.tiled-attention" for t in PACK_NODES)
    for t in PACK_NODES:
        for name, spec in (info[t]["input"].get("required") or {}).items():
            assert wapi.spec_options(spec).get("tooltip"), f"{version}: {t}.{name} has no tooltip"


def test_live_schemas_of_both_versions_agree_on_the_pack(oi_new, oi_old):
    for t in PACK_NODES:
        assert oi_new[t]["input"] == oi_old[t]["input"], t
        assert oi_new[t]["input_order"] == oi_old[t]["input_order"], t
        assert oi_new[t]["output"] == oi_old[t]["output"], t


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_text_encoder_and_vae_go_through_the_pack(path):
    wf = load(path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = wapi.parse_links(wf)
    checked = 0
    for n in wf["nodes"]:
        for inp in n.get("inputs") or []:
            if inp.get("link") is None or inp.get("type") not in ("CLIP", "VAE"):
                continue
            origin = nodes[links[inp["link"]][0]]
            if origin["type"] == "LTXVAudioVAELoader":
                continue  # the LTX audio VAE computes its attention itself (bmm + softmax): nothing to route
            want = "TiledAttentionPatchCLIP" if inp["type"] == "CLIP" else "TiledAttentionPatchVAE"
            if n["type"] == want:
                continue
            assert origin["type"] == want, f"node {n['id']} ({n['type']}) input {inp['name']} comes from " \
                                            f"{origin['type']}, not {want}"
            checked += 1
    assert checked >= 2  # a text encode and a decode at the least (Z-Image's negative is ConditioningZeroOut)


def test_saved_before_v3_are_todays_main_workflows():
    # saved under the names the workflows had before they were named as the Templates browser shows them
    assert {wapi.RENAMED_WORKFLOWS[name] for name in OLD_IDS} == set(wapi.RENAMED_WORKFLOWS.values())
    assert set(wapi.RENAMED_WORKFLOWS.values()) < EXPECTED_WORKFLOWS  # the Wan 14B and Z-Image ones came later
    for path in OLD_WORKFLOWS:
        assert {"TiledAttentionPatch", "TiledFFNChunking"} <= real_types(load(path))


@pytest.mark.parametrize("path", OLD_WORKFLOWS, ids=OLD_IDS)
def test_workflows_saved_before_v3_load_unchanged(path, oi_new, oi_old):
    """The V1-era JSON validates against both live servers and its pack widgets keep their values."""
    wf = load(path)
    versions = [oi_new] + ([oi_old] if real_types(wf) <= set(oi_old) else [])
    for oi in versions:
        assert ws.validate_workflow(wf, oi) == []
        prompt = wapi.workflow_to_prompt(wf, oi)
        for n in wf["nodes"]:
            if n["type"] not in ("TiledAttentionPatch", "TiledFFNChunking"):
                continue
            inputs = {k: v for k, v in prompt[str(n["id"])]["inputs"].items() if k != "model"}
            names = {"TiledAttentionPatch": ["mode", "memory_budget_mb", "half_precision", "min_tokens"],
                     "TiledFFNChunking": ["chunks", "enabled"]}[n["type"]]
            assert inputs == dict(zip(names, n["widgets_values"])), (n["type"], inputs)
