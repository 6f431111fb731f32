"""Static validation of UI-format ComfyUI workflows against /object_info schemas.

``validate_workflow(workflow, object_info)`` returns a list of human-readable
problems (empty when the workflow is fine).  Every problem about a node names
the node id, node type and, where it applies, the input.

The schemas come from live servers (live_schema.py); this module only reads
them.

Widget-value matching is shared with ``tools/workflow_api.py``.
"""

import json
import os
import re

from tools import workflow_api as wapi
from tools.comfyui_setup.comfyui import ROOT, SHARED

SHARED_COMFYUI = os.path.join(SHARED, "comfyui")
OBJECT_INFO_NEW = os.path.join(SHARED_COMFYUI, "object_info-0.33.0.json")
OBJECT_INFO_OLD = os.path.join(SHARED_COMFYUI, "object_info-0.3.75.json")

FRONTEND_ONLY_TYPES = wapi.FRONTEND_ONLY_TYPES
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})
# (loader node type, model-file input) of the bundled workflows -> the ComfyUI models folder it reads, which is
# also the `directory` of the node's `properties.models` entry for that file
LOADER_FOLDERS = {
    ("UNETLoader", "unet_name"): "diffusion_models",
    ("CLIPLoader", "clip_name"): "text_encoders",
    ("VAELoader", "vae_name"): "vae",
    ("CheckpointLoaderSimple", "ckpt_name"): "checkpoints",
    ("LTXAVTextEncoderLoader", "text_encoder"): "text_encoders",
    ("LTXAVTextEncoderLoader", "ckpt_name"): "checkpoints",
    ("LTXVAudioVAELoader", "ckpt_name"): "checkpoints",
    ("LoraLoaderModelOnly", "lora_name"): "loras",
    ("LatentUpscaleModelLoader", "model_name"): "latent_upscale_models",
}


def load_object_info(path):
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------
# model-file combos
# --------------------------------------------------------------------------

MODEL_INPUT_NAMES = frozenset({
    "ckpt_name", "unet_name", "clip_name", "vae_name", "lora_name", "model_name",
    "text_encoder", "audio_vae", "control_net_name", "style_model_name",
    "upscale_model", "gligen_name", "audio_encoder_name", "clip_vision",
})
FILE_VALUE_RE = re.compile(r"([\\/])|\.(safetensors|sft|ckpt|pt|pth|bin|gguf|onnx|pkl|pickle)$", re.IGNORECASE)
INPUT_FILE_RE = re.compile(r"\.(png|jpe?g|webp|gif|bmp|tiff?|mp4|webm|mov|mkv|avi|wav|mp3|flac|ogg|m4a)$", re.IGNORECASE)


def is_model_file_input(name, options, value):
    """A loader combo whose choices are the server's model files (unknowable offline)."""
    base = name.rsplit(".", 1)[-1]
    if not (base in MODEL_INPUT_NAMES or base == "name" or base.endswith("_name") or re.match(r"clip_name\d$", base)):
        return False
    if not options:
        return True
    if any(isinstance(o, str) and FILE_VALUE_RE.search(o) for o in options):
        return True
    return isinstance(value, str) and bool(FILE_VALUE_RE.search(value))


def _is_upload_file_input(spec, value):
    return wapi.has_upload_widget(spec) and isinstance(value, str) and bool(INPUT_FILE_RE.search(value))


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_widget_value(name, kind, spec, value, *, ignore_model_files=True):
    """Problem text for one widget value, or None when it is acceptable."""
    opts = wapi.spec_options(spec)
    if kind in ("INT", "FLOAT"):
        if kind == "INT" and not _is_int(value):
            return f"expects an INT, got {value!r}"
        if kind == "FLOAT" and not _is_number(value):
            return f"expects a FLOAT, got {value!r}"
        lo, hi = opts.get("min"), opts.get("max")
        if _is_number(lo) and value < lo:
            return f"value {value!r} is below the minimum {lo}"
        if _is_number(hi) and value > hi:
            return f"value {value!r} is above the maximum {hi}"
        return None
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"expects a BOOLEAN, got {value!r}"
    if kind == "STRING":
        return None if isinstance(value, str) else f"expects a STRING, got {value!r}"
    if kind in ("COMBO", wapi.DYNAMIC_COMBO):
        options = wapi.combo_options(spec)
        if isinstance(value, dict) and "__value__" in value:  # multiselect
            value = value["__value__"]
        vals = value if isinstance(value, list) else [value]
        bad = [v for v in vals if v not in options]
        if not bad:
            return None
        if kind == "COMBO" and ignore_model_files:
            if all(is_model_file_input(name, options, v) or _is_upload_file_input(spec, v) for v in bad):
                return None
        shown = options if len(options) <= 12 else options[:12] + ["..."]
        return f"value {bad[0]!r} is not one of {shown}"
    return None


# --------------------------------------------------------------------------
# the validator
# --------------------------------------------------------------------------

def _node_label(node):
    return f"node {node.get('id')} ({node.get('type')})"


def _where(node, input_name=None):
    s = _node_label(node)
    if input_name is not None:
        s += f" input '{input_name}'"
    return s


def _schema_sockets(node_def, widget_slots):
    """{input name: (spec, section)} for every input a node of this type may show."""
    out = {}
    for name, spec, section in wapi.iter_inputs(node_def):
        out[name] = (spec, section)
    for name, spec, section, _kind in widget_slots:
        out.setdefault(name, (spec, section))
    return out


def _output_type(node, slot, object_info):
    ntype = node.get("type")
    if ntype in object_info:
        types = wapi.output_types(object_info[ntype])
        if 0 <= slot < len(types):
            return types[slot]
        return None
    outs = node.get("outputs") or []
    if 0 <= slot < len(outs):
        return outs[slot].get("type")
    return None


def _input_type(node, slot, object_info):
    """(input name, schema socket type) of a node's slot-th input entry."""
    inputs = node.get("inputs") or []
    if not 0 <= slot < len(inputs):
        return None, None
    name = inputs[slot].get("name")
    ntype = node.get("type")
    if ntype in object_info:
        node_def = object_info[ntype]
        _vals, slots, _extra = wapi.map_widget_values(node.get("widgets_values"), node_def)
        spec = _schema_sockets(node_def, slots).get(name, (None, None))[0]
        if spec is not None:
            return name, _socket_type(spec)
    return name, inputs[slot].get("type")


def _socket_type(spec):
    t = wapi.socket_type(spec)
    if t == "COMFY_MATCHTYPE_V3":
        allowed = (wapi.spec_options(spec).get("template") or {}).get("allowed_types")
        return allowed if isinstance(allowed, str) and allowed else "*"
    if isinstance(t, str) and t.startswith("COMFY_") and t.endswith("_V3") and t != wapi.DYNAMIC_COMBO:
        return "*"
    return t


def _types_ok(a, b):
    a = "*" if a == "COMFY_MATCHTYPE_V3" else a
    b = "*" if b == "COMFY_MATCHTYPE_V3" else b
    return wapi.types_compatible(a, b)


def validate_workflow(workflow, object_info, *, ignore_model_files=True,
                      require_pack_nodes=("TiledAttentionPatch",)):
    """Problems found in a UI-format workflow, as a list of strings (empty if none).

    Checks node types, required inputs (linked or given as widgets), widget
    values (type, min/max, combo choices -- model file names of loader combos
    are skipped when ``ignore_model_files``), link types against the schemas,
    the link table against the nodes' input/output lists, and that the
    ``require_pack_nodes`` types are used and known to ``object_info``.
    """
    problems = []
    if not isinstance(workflow, dict) or not isinstance(workflow.get("nodes"), list):
        return ["workflow: no 'nodes' list (not a UI-format workflow)"]
    if not isinstance(workflow.get("links"), list):
        problems.append("workflow: no 'links' list")

    nodes = {}
    for node in workflow["nodes"]:
        nid = node.get("id")
        if nid in nodes:
            problems.append(f"{_node_label(node)}: duplicate node id {nid}")
        nodes[nid] = node
    max_id = max((n for n in nodes if isinstance(n, int)), default=0)
    if isinstance(workflow.get("last_node_id"), int) and workflow["last_node_id"] < max_id:
        problems.append(f"workflow: last_node_id {workflow['last_node_id']} is below the highest node id {max_id}")

    raw_links = workflow.get("links") or []
    links = {}
    for link in raw_links:
        if isinstance(link, dict):
            lid = link.get("id")
            entry = (link.get("origin_id"), link.get("origin_slot"), link.get("target_id"),
                     link.get("target_slot"), link.get("type"))
        elif isinstance(link, (list, tuple)) and len(link) == 6:
            lid, entry = link[0], tuple(link[1:])
        else:
            problems.append(f"link table: malformed entry {link!r}")
            continue
        if lid in links:
            problems.append(f"link {lid}: duplicate link id")
        links[lid] = entry
    max_link = max((l for l in links if isinstance(l, int)), default=0)
    if isinstance(workflow.get("last_link_id"), int) and workflow["last_link_id"] < max_link:
        problems.append(f"workflow: last_link_id {workflow['last_link_id']} is below the highest link id {max_link}")

    # ---- nodes -----------------------------------------------------------
    for node in workflow["nodes"]:
        ntype = node.get("type")
        mode = node.get("mode", 0)
        if mode not in (0, 1, 2, 3, 4):
            problems.append(f"{_node_label(node)}: unknown mode {mode!r}")
        if ntype in NOTE_TYPES:
            wv = node.get("widgets_values")
            if not (isinstance(wv, list) and wv and isinstance(wv[0], str)):
                problems.append(f"{_node_label(node)}: a note needs its text as widgets_values[0]")
        known = ntype in object_info
        if not known and ntype not in FRONTEND_ONLY_TYPES:
            problems.append(f"{_node_label(node)}: unknown node type {ntype!r} (not in object_info)")

        # input entries vs link table (all node kinds)
        for idx, inp in enumerate(node.get("inputs") or []):
            lid = inp.get("link")
            if lid is None:
                continue
            if lid not in links:
                problems.append(f"{_where(node, inp.get('name'))}: link {lid} is not in the link table")
                continue
            o_id, o_slot, t_id, t_slot, _t = links[lid]
            if t_id != node.get("id") or t_slot != idx:
                problems.append(f"{_where(node, inp.get('name'))}: link {lid} targets node {t_id} slot {t_slot}, "
                                f"but it sits in node {node.get('id')} slot {idx}")
        for idx, out in enumerate(node.get("outputs") or []):
            for lid in out.get("links") or []:
                if lid not in links:
                    problems.append(f"{_node_label(node)} output {idx} ('{out.get('name')}'): "
                                    f"link {lid} is not in the link table")
                    continue
                o_id, o_slot = links[lid][0], links[lid][1]
                if o_id != node.get("id") or o_slot != idx:
                    problems.append(f"{_node_label(node)} output {idx} ('{out.get('name')}'): link {lid} "
                                    f"starts at node {o_id} slot {o_slot}")

        if not known:
            continue
        node_def = object_info[ntype]
        values, slots, extra = wapi.map_widget_values(node.get("widgets_values"), node_def)
        sockets = _schema_sockets(node_def, slots)
        if extra:
            problems.append(f"{_node_label(node)}: {len(extra)} unexpected widget value(s) {extra!r} "
                            f"(widgets: {[s[0] for s in slots]})")

        linked = set()
        for inp in node.get("inputs") or []:
            name = inp.get("name")
            if name not in sockets:
                problems.append(f"{_where(node, name)}: no such input on {ntype}")
                continue
            spec = sockets[name][0]
            want = _socket_type(spec)
            if inp.get("type") is not None and not _types_ok(inp.get("type"), want):
                problems.append(f"{_where(node, name)}: declared type {inp.get('type')!r} but the schema says {want!r}")
            if inp.get("link") is not None:
                linked.add(name)

        # required inputs
        for name, spec, section in wapi.iter_inputs(node_def, sections=("required",)):
            kind = wapi.widget_kind(spec)
            if name in linked or wapi.spec_options(spec).get("hidden"):
                continue
            if kind is None:
                problems.append(f"{_where(node, name)}: required input ({_socket_type(spec)}) is not connected")
            elif name not in values:
                problems.append(f"{_where(node, name)}: required widget has no value")
        for name, spec, section, kind in slots:
            if "." in name and section == "required" and name not in values and name not in linked:
                problems.append(f"{_where(node, name)}: required widget has no value")

        # widget values
        for name, spec, section, kind in slots:
            if name in linked or name not in values:
                continue
            msg = check_widget_value(name, kind, spec, values[name], ignore_model_files=ignore_model_files)
            if msg:
                problems.append(f"{_where(node, name)}: {msg}")

        # outputs vs schema
        schema_out = wapi.output_types(node_def)
        outs = node.get("outputs") or []
        for idx in range(len(schema_out), len(outs)):
            # An unlinked extra output is harmless (the frontend rebuilds outputs from the
            # schema); e.g. SaveVideo gained a VIDEO pass-through output after 0.3.75.
            if outs[idx].get("links"):
                problems.append(f"{_node_label(node)} output {idx} ('{outs[idx].get('name')}'): "
                                f"linked, but the schema has only {len(schema_out)} outputs")
        for idx, out in enumerate(outs[:len(schema_out)]):
            if out.get("type") is not None and not _types_ok(out.get("type"), schema_out[idx]):
                problems.append(f"{_node_label(node)} output {idx} ('{out.get('name')}'): declared type "
                                f"{out.get('type')!r} but the schema says {schema_out[idx]!r}")

    # ---- links -----------------------------------------------------------
    for lid, (o_id, o_slot, t_id, t_slot, ltype) in links.items():
        origin, target = nodes.get(o_id), nodes.get(t_id)
        if origin is None:
            problems.append(f"link {lid}: origin node {o_id} does not exist")
        if target is None:
            problems.append(f"link {lid}: target node {t_id} does not exist")
        if origin is None or target is None:
            continue
        t_inputs = target.get("inputs") or []
        if not isinstance(t_slot, int) or not 0 <= t_slot < len(t_inputs):
            problems.append(f"{_node_label(target)}: link {lid} targets input slot {t_slot}, "
                            f"the node lists {len(t_inputs)} inputs")
            continue
        t_name = t_inputs[t_slot].get("name")
        if t_inputs[t_slot].get("link") != lid:
            problems.append(f"{_where(target, t_name)}: link {lid} targets this slot but the input holds "
                            f"link {t_inputs[t_slot].get('link')}")
        o_outputs = origin.get("outputs") or []
        if not isinstance(o_slot, int) or not 0 <= o_slot < len(o_outputs):
            problems.append(f"{_where(target, t_name)}: link {lid} comes from {_node_label(origin)} output "
                            f"{o_slot}, which the node does not list")
            continue
        if lid not in (o_outputs[o_slot].get("links") or []):
            problems.append(f"{_node_label(origin)} output {o_slot}: link {lid} to node {t_id} "
                            f"is missing from the output's links")
        o_type = _output_type(origin, o_slot, object_info)
        if o_type is None:
            problems.append(f"{_where(target, t_name)}: link {lid} comes from {_node_label(origin)} output "
                            f"{o_slot}, which its schema does not have")
            continue
        _n, t_type = _input_type(target, t_slot, object_info)
        if ltype is not None and not _types_ok(ltype, o_type):
            problems.append(f"{_where(target, t_name)}: link {lid} is typed {ltype!r} but "
                            f"{_node_label(origin)} output {o_slot} gives {o_type!r}")
        if t_type is not None and not _types_ok(o_type, t_type):
            problems.append(f"{_where(target, t_name)}: link {lid} carries {o_type!r} from "
                            f"{_node_label(origin)} output {o_slot}, but the input takes {t_type!r}")

    # ---- this pack ---------------------------------------------------------
    for ptype in require_pack_nodes or ():
        if ptype not in object_info:
            problems.append(f"workflow: pack node type {ptype!r} is not in object_info")
        if not any(n.get("type") == ptype and n.get("mode", 0) == 0 for n in workflow["nodes"]):
            problems.append(f"workflow: no active {ptype} node")
    return problems
