"""Patch Attention on a GGUF-loaded Wan 2.2 14B expert, as the 14B workflows' notes tell users to swap it in: city96's
ComfyUI-GGUF (its UnetLoaderGGUF, GGMLOps and GGUFModelPatcher) in the custom_nodes of a real ComfyUI 0.33.0 (the
real pack where a clone of it is here, else tools/fixtures/comfyui_gguf_standin, which follows it on this path;
the test prints which), the high-noise expert written as a Q8_0 GGUF file of the tiny architecture
(tools/fixtures/tiny_models_wan14.write_gguf_expert), the bundled text-to-video workflow with that expert's
*Load Diffusion Model* replaced by *Unet Loader (GGUF)* feeding the same Patch Attention.

With the pack on (mode chunked, min_tokens 0) every DiT attention call of both experts ran in the engine, as many as
reached ComfyUI's attention with the pack off, none outside; the sampled latent agrees with the unpatched one within
TOL_EPS fp32 epsilon of its largest value.

The real pack is taken from TILED_ATTENTION_GGUF_PACK, or a clone at .cache/ComfyUI-GGUF
(`git clone https://github.com/city96/ComfyUI-GGUF .cache/ComfyUI-GGUF`); where neither is there (CI: no network but
package registries; fetched third-party code is not committed) the stand-in runs. Where the real pack is here,
test_standin_follows_the_real_pack checks that the stand-in has its node id, inputs, classes, bases and methods on
this path. Both runs load through the same loader, so the stand-in's own path is checked apart: its dequantization
against gguf's (test_standin_dequantizes_as_gguf_does), and in-process that its models stay GGUFModelPatchers with
quantized weights and Patch Attention's override through every clone. Needs the `gguf` package
(tests/requirements-test.txt pins it).
"""
import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from comfy_harness import load_pack, missing
from tools.comfyui_setup.comfyui import LATEST, ROOT, comfy_path
from tools.comfyui_setup.comfy_server import FIXTURES, ComfyServer
from tools.comfyui_setup.prompt_tools import attention_census, resized, saved_latents, workflow_api
from tools.fixtures.tiny_models_wan14 import HIGH_LAYERS, LOW_LAYERS

NAME = "Wan 2.2 14B Text to Video 480p"
GGUF_FILE = "wan2.2_t2v_high_noise_14B_Q8_0.gguf"
SITES = ("WanAttentionBlock.self_attn", "WanAttentionBlock.cross_attn")
BOUND = 1000 * torch.finfo(torch.float32).eps
WRITE = ("import sys; from tools.comfyui_setup.comfyui import import_comfy; import_comfy(sys.argv[2]); "
         "from tools.fixtures.tiny_models_wan14 import write_wan14_model_set, write_gguf_expert; "
         "write_wan14_model_set(sys.argv[1] + '/models', tasks=('t2v',)); "
         f"write_gguf_expert(sys.argv[1] + '/models/unet/{GGUF_FILE}')")


STANDIN = os.path.join(FIXTURES, "comfyui_gguf_standin")


def real_pack():
    """The real ComfyUI-GGUF's folder, or None where it is not here."""
    path = os.environ.get("TILED_ATTENTION_GGUF_PACK") or os.path.join(ROOT, ".cache", "ComfyUI-GGUF")
    return path if os.path.isfile(os.path.join(path, "loader.py")) else None


def gguf_pack():
    """(folder, name under custom_nodes, words for the output): the real pack where present, else the stand-in."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        missing("the gguf package is absent (tests/requirements-test.txt pins it)")
    real = real_pack()
    if real is not None:
        return real, "ComfyUI-GGUF", f"city96's ComfyUI-GGUF at {real}"
    return STANDIN, "comfyui_gguf_standin", ("the stand-in tools/fixtures/comfyui_gguf_standin (no ComfyUI-GGUF at "
                                             "TILED_ATTENTION_GGUF_PACK or .cache/ComfyUI-GGUF)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pack, folder, which = gguf_pack()
    if comfy_path(LATEST) is None:
        missing(f"no ComfyUI {LATEST} (./dev setup)")
    base = tmp_path_factory.mktemp("wan14_gguf")
    made = subprocess.run([sys.executable, "-c", WRITE, str(base), LATEST], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    os.makedirs(base / "custom_nodes", exist_ok=True)
    os.symlink(os.path.abspath(pack), base / "custom_nodes" / folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILED_ATTENTION_TEST_CENSUS", "1")
        mp.delenv("TILED_ATTENTION_TEST_BREAK", raising=False)
        srv = ComfyServer(base, version=LATEST).start()
    srv.which = which
    yield srv
    srv.stop()


def run(server, mode):
    info = server.get("/object_info")
    assert "UnetLoaderGGUF" in info, f"{server.which} did not load:\n" + server.log()[-3000:]
    with open(os.path.join(ROOT, "workflows", NAME + ".json"), encoding="utf-8") as f:
        prompt = workflow_api().workflow_to_prompt(json.load(f), info)
    tag = f"gguf/{mode}"
    p = resized(prompt, tag, size=(64, 64), frames=5, steps=4)
    swapped = 0
    for node in p.values():
        if node["class_type"] in ("TiledAttentionPatch", "TiledAttentionPatchCLIP", "TiledAttentionPatchVAE"):
            node["inputs"].update(mode=mode, min_tokens=0)
        elif node["class_type"] == "KSamplerAdvanced":
            node["inputs"]["end_at_step" if node["inputs"]["add_noise"] == "enable" else "start_at_step"] = 2
        elif node["class_type"] == "UNETLoader" and "_high_noise_" in node["inputs"]["unet_name"]:
            node["class_type"], node["inputs"] = "UnetLoaderGGUF", {"unet_name": GGUF_FILE}
            swapped += 1
    assert swapped == 1
    pid, _entry = server.queue_prompt(p)
    census = attention_census(server.log()).get(pid)
    return ({k: {s: sum(n.values()) for s, n in census.get(k, {}).items()} for k in ("engine", "comfy", "torch_sdpa")},
            saved_latents(server.base, tag))


def test_patch_attention_on_a_gguf_loaded_expert(server):
    off, plain = run(server, "off")
    on, patched = run(server, "chunked")
    log = server.log()
    assert "gguf qtypes: F32" in log and "Q8_0" in log, "the expert was not loaded from the GGUF file"
    print(f"\nGGUF loader: {server.which}\npack off: {json.dumps(off)}\npack on:  {json.dumps(on)}")
    for site in SITES:  # the GGUF high expert and the safetensors low expert, 2 steps each
        assert off["comfy"][site] % (HIGH_LAYERS + LOW_LAYERS) == 0 and off["comfy"][site] > 0, off
        assert on["engine"].get(site) == off["comfy"][site], (site, off, on)
    assert on["comfy"] == {} and on["torch_sdpa"] == {}, on
    a, b = patched[0].double(), plain[0].double()
    dev = float((a - b).abs().max() / b.abs().max())
    print(f"GGUF expert: latent deviates by {dev:.3e} of its max = {dev / torch.finfo(torch.float32).eps:.1f} fp32 eps")
    assert dev <= BOUND, dev


# what of the real pack the stand-in must have, read from the source of both (nothing imported, so this runs without
# ComfyUI): the classes on the loading and patching path with their bases and methods, the module-level functions
# that path calls, the node's id and inputs, and the calls into ComfyUI and gguf
CLASSES = ("GGUFModelPatcher", "UnetLoaderGGUF", "GGMLTensor", "GGMLLayer", "GGMLOps", "GGMLOps.Linear",
           "GGMLOps.Conv2d", "GGMLOps.Embedding", "GGMLOps.LayerNorm", "GGMLOps.GroupNorm")
FUNCTIONS = ("gguf_sd_loader", "dequantize_tensor", "is_quantized", "is_torch_compatible", "move_patch_to_device",
             "update_folder_names_and_paths")
CALLS = ("gguf.GGUFReader", "comfy.sd.load_diffusion_model_state_dict", "GGUFModelPatcher.clone",
         "folder_paths.get_full_path", "folder_paths.get_filename_list", "logging.info")


def outline(folder):
    """{"classes": {qualname: (bases, {method: parameters after the first})}, "functions": names, "calls": dotted
    names called, "strings": string constants, "node": {id: class name}, "inputs": strings in UnetLoaderGGUF's
    INPUT_TYPES, "attrs": UnetLoaderGGUF's RETURN_TYPES/FUNCTION/CATEGORY/TITLE} over the pack's four modules."""
    out = {"classes": {}, "functions": set(), "calls": set(), "strings": set(), "node": {}, "inputs": set(),
           "attrs": {}}

    def params(f):
        a = f.args
        names = [x.arg for x in a.posonlyargs + a.args][1:] + [x.arg for x in a.kwonlyargs]
        return tuple(names) + (("*" + a.vararg.arg,) if a.vararg else ()) + (("**" + a.kwarg.arg,) if a.kwarg else ())

    def walk_class(c, prefix):
        name = prefix + c.name
        methods = {f.name: params(f) for f in c.body if isinstance(f, ast.FunctionDef)}
        out["classes"][name] = (tuple(ast.unparse(b) for b in c.bases), methods)
        for inner in c.body:
            if isinstance(inner, ast.ClassDef):
                walk_class(inner, name + ".")
        if c.name == "UnetLoaderGGUF":
            for item in c.body:
                if isinstance(item, ast.FunctionDef) and item.name == "INPUT_TYPES":
                    out["inputs"] = {n.value for n in ast.walk(item) if isinstance(n, ast.Constant)
                                     and isinstance(n.value, str)}
                elif isinstance(item, ast.Assign) and len(item.targets) == 1:
                    out["attrs"][ast.unparse(item.targets[0])] = ast.literal_eval(item.value)

    for module in ("nodes", "ops", "loader", "dequant"):
        with open(os.path.join(folder, module + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                walk_class(node, "")
            elif isinstance(node, ast.FunctionDef):
                out["functions"].add(node.name)
            elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "NODE_CLASS_MAPPINGS":
                out["node"] = {k.value: ast.unparse(v) for k, v in zip(node.value.keys, node.value.values)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                out["calls"].add(ast.unparse(n.func))
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                out["strings"].add(n.value)
    return out


def test_standin_follows_the_real_pack():
    real = real_pack()
    if real is None:
        pytest.skip("not applicable: no clone of ComfyUI-GGUF here (TILED_ATTENTION_GGUF_PACK or .cache/ComfyUI-GGUF) "
                    "to compare the stand-in with; the stand-in itself is exercised by the test above")
    want, have = outline(real), outline(STANDIN)
    print(f"\ncomparing tools/fixtures/comfyui_gguf_standin with {real}")
    assert want["node"]["UnetLoaderGGUF"] == have["node"]["UnetLoaderGGUF"] == "UnetLoaderGGUF", have["node"]
    assert have["inputs"] == want["inputs"] == {"required", "unet_name", "unet_gguf"}, (want["inputs"], have["inputs"])
    assert have["attrs"] == want["attrs"], (want["attrs"], have["attrs"])
    for name in CLASSES:
        (w_bases, w_methods), (h_bases, h_methods) = want["classes"][name], have["classes"].get(name, (None, {}))
        assert h_bases == w_bases, (name, w_bases, h_bases)
        for method, args in w_methods.items():
            assert h_methods.get(method) == args, (f"{name}.{method}", args, h_methods.get(method))
    assert set(FUNCTIONS) <= want["functions"] and set(FUNCTIONS) <= have["functions"], \
        set(FUNCTIONS) - have["functions"]
    assert set(CALLS) <= want["calls"] and set(CALLS) <= have["calls"], set(CALLS) - have["calls"]
    for s in ("gguf qtypes: ", "custom_operations", "model.diffusion_model.", "comfy.gguf.orig_shape."):
        assert any(s in x for x in want["strings"]) and any(s in x for x in have["strings"]), s


@pytest.mark.parametrize("qtype", ["Q8_0", "BF16", "F16", "F32"])
def test_standin_dequantizes_as_gguf_does(qtype):
    """Both runs of the first test dequantize with the same loader, so a wrong dequantization would not show there:
    the stand-in's torch dequantization must give gguf's own numpy dequantization of the same bytes, bit for bit."""
    try:
        import gguf
    except ImportError:
        missing("the gguf package is absent (tests/requirements-test.txt pins it)")
    import importlib.util
    spec = importlib.util.spec_from_file_location("comfyui_gguf_standin_dequant", os.path.join(STANDIN, "dequant.py"))
    dequant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dequant)  # gguf and torch only; no ComfyUI
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    values = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).numpy()
    raw = gguf.quants.quantize(values, kind)
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype("float32"))
    t = torch.from_numpy(raw)
    t = t.view(torch.float16 if qtype == "F16" else torch.float32) if qtype in ("F16", "F32") else t
    t.tensor_type, t.tensor_shape = kind, torch.Size((48, 64))
    got = dequant.dequantize_tensor(t, torch.float32, dequant_dtype="target")  # computed in float32
    assert got.shape == want.shape and torch.equal(got, want), (qtype, float((got - want).abs().max()))
    # by default (the loader's dequant_dtype None) the real pack multiplies in the scale's float16: one rounding
    fp16 = dequant.dequantize_tensor(t, torch.float32)
    assert torch.equal(fp16, want.half().float() if qtype == "Q8_0" else want), qtype


def load_standin():
    """The stand-in imported as ComfyUI imports a custom node folder (a package under its own name)."""
    import importlib.util
    name = "comfyui_gguf_standin"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(STANDIN, "__init__.py"),
                                                      submodule_search_locations=[STANDIN])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_standin_patcher_keeps_gguf_weights_and_the_override_through_clones(tmp_path):
    """In-process (ComfyUI 0.33.0), the stand-in's own path: the loaded model is a GGUFModelPatcher whose linear
    weights stay Q8_0 GGMLTensors; Patch Attention's clone, and every later clone (the sampler clones the model),
    stay GGUFModelPatchers with the pack's override in their model_options."""
    import asyncio
    pack = load_pack()
    try:
        import gguf
    except ImportError:
        missing("the gguf package is absent (tests/requirements-test.txt pins it)")
    import comfy.sd
    import folder_paths
    from tools.fixtures.tiny_models_wan14 import write_gguf_expert
    before = folder_paths.folder_names_and_paths.get("unet_gguf")
    try:
        standin = load_standin()
        sd = standin.loader.gguf_sd_loader(write_gguf_expert(str(tmp_path / GGUF_FILE)))
        loaded = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations":
                                                                             standin.ops.GGMLOps()})
        model = standin.nodes.GGUFModelPatcher.clone(loaded)
    finally:  # the stand-in registers its file list at import, as the real pack does: not left behind here
        if before is None:
            folder_paths.folder_names_and_paths.pop("unet_gguf", None)
        else:
            folder_paths.folder_names_and_paths["unet_gguf"] = before
    extension = asyncio.run(pack.comfy_entrypoint())
    patch = {c.GET_SCHEMA().node_id: c for c in asyncio.run(extension.get_node_list())}["TiledAttentionPatch"]
    patched = patch.execute(model, "chunked", 0, "keep", 0)[0]
    again = patched.clone().clone()
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    for m in (model, patched, again):
        assert type(m) is standin.nodes.GGUFModelPatcher, type(m)
        w = m.model.diffusion_model.blocks[0].self_attn.q.weight
        assert isinstance(w, standin.ops.GGMLTensor) and w.tensor_type == gguf.GGMLQuantizationType.Q8_0, type(w)
    assert again.model_options["transformer_options"].get("optimized_attention_override") is override
    assert "optimized_attention_override" not in model.model_options.get("transformer_options", {})
