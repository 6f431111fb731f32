#!/usr/bin/env python3
"""Convert a ComfyUI UI-format workflow (what the frontend saves) into an
API-format prompt (what ``POST /prompt`` takes).

Library use (load this file by path; it imports nothing but the stdlib)::

    import importlib.util
    spec = importlib.util.spec_from_file_location("workflow_api", "tools/workflow_api.py")
    workflow_api = importlib.util.module_from_spec(spec); spec.loader.exec_module(workflow_api)
    prompt = workflow_api.workflow_to_prompt(workflow, object_info)

Command line::

    python tools/workflow_api.py WORKFLOW.json [--object-info FILE | --server URL] [--queue]

A bundled workflow's old file name (``workflows/wan22_5b_t2v_480p.json``, before they were named as the
Templates browser shows them) still works: it converts the renamed file (``RENAMED_WORKFLOWS``).

Without ``--queue`` the prompt is printed (or written with ``-o``).  With
``--queue`` it is posted to ``SERVER/prompt`` as ``{"prompt": ..., "extra_data":
{"extra_pnginfo": {"workflow": ...}}}`` (the same shape the frontend sends, so
Save nodes embed the workflow).  Every problem -- unreadable, empty or
malformed JSON (a byte-order mark, NaN/Infinity, duplicate keys), a workflow
the converter cannot trust (duplicate node ids, links with null slots,
``widgets_values`` that is neither a list nor an object, a non-numeric
``order``), a server that cannot be reached or answers something other than
JSON -- is one ``error: ...`` line on stderr and exit status 2; nothing is
guessed or converted silently.

What the converter mirrors from the frontend's ``graphToPrompt``:

* ``widgets_values`` are matched in order to the node's widget inputs from
  ``/object_info`` (INT, FLOAT, STRING, BOOLEAN, combos, ``FLOAT,INT`` style
  inputs that declare a ``widgetType``, V3 dynamic combos whose child widgets
  follow the parent and are sent as dotted keys such as ``format.codec``).
  Inputs with ``forceInput`` or ``hidden`` are sockets, not widgets.
* The frontend stores one extra value after a widget that has a
  "control after generate" companion: an INT whose options carry
  ``control_after_generate`` (``true`` in 0.3.75, ``"fixed"`` etc. in 0.33.0;
  an explicit ``false`` turns it off) or, when the option is absent, an INT
  named ``seed``/``noise_seed``; and a combo whose options set it.  It also
  stores the value of the upload button after ``image_upload``-style combos
  (``"image"``).  Those values are skipped, never sent.
* A widget input that is linked takes the link instead of its widget value.
* ``Note``/``MarkdownNote`` are dropped; ``Reroute`` and ``PrimitiveNode``
  are resolved through (a PrimitiveNode contributes its value); bypassed nodes
  (mode 4) pass a link through to their first input of the matching type;
  muted nodes (mode 2) are dropped together with every input linked to them.
* Array widget values are wrapped as ``{"__value__": [...]}``.

Subgraphs (node types that are UUIDs under ``definitions.subgraphs``) are not
supported and raise ``ValueError``.
"""

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

__all__ = [
    "FRONTEND_ONLY_TYPES",
    "workflow_to_prompt",
    "map_widget_values",
    "widget_inputs",
    "iter_inputs",
    "widget_kind",
    "spec_options",
    "combo_options",
    "types_compatible",
    "parse_links",
    "load_object_info",
    "RENAMED_WORKFLOWS",
    "renamed_workflow",
]

FRONTEND_ONLY_TYPES = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
# The bundled workflows were renamed to the titles ComfyUI's Templates browser shows (it shows a pack's
# template by its file name); a path to an old name that is gone converts the renamed file in the same folder.
RENAMED_WORKFLOWS = {
    "ltx23_22b_i2v_av_720p.json": "LTX-2.3 Image to Video 720p.json",
    "ltx23_22b_t2v_av_1080p.json": "LTX-2.3 Text to Video 1080p.json",
    "ltx23_22b_t2v_av_720p.json": "LTX-2.3 Text to Video 720p.json",
    "wan22_5b_i2v_480p.json": "Wan 2.2 5B Image to Video 480p.json",
    "wan22_5b_t2v_480p.json": "Wan 2.2 5B Text to Video 480p.json",
    "wan22_5b_t2v_720p.json": "Wan 2.2 5B Text to Video 720p.json",
}
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})

MODE_ALWAYS = 0
MODE_NEVER = 2  # "muted"
MODE_BYPASS = 4

DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
PLAIN_WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN"})
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
UPLOAD_VALUES = frozenset({"image", "video", "audio", "file", "upload", ""})

_MISSING = object()


# --------------------------------------------------------------------------
# /object_info schema helpers
# --------------------------------------------------------------------------

def spec_options(spec):
    """The options dict of an input spec ``[type, {options}]`` (or {})."""
    if isinstance(spec, (list, tuple)) and len(spec) > 1 and isinstance(spec[1], dict):
        return spec[1]
    return {}


def combo_options(spec):
    """Choices of a combo input: V1 ``[[a, b], {...}]`` or V3 ``["COMBO", {"options": [...]}]``.

    For a dynamic combo the choices are the option keys.
    """
    if not isinstance(spec, (list, tuple)) or not spec:
        return []
    if isinstance(spec[0], (list, tuple)):
        return list(spec[0])
    opts = spec_options(spec).get("options") or []
    out = []
    for o in opts:
        if isinstance(o, dict):
            if "key" in o:
                out.append(o["key"])
        else:
            out.append(o)
    return out


def widget_kind(spec):
    """What widget the frontend makes for an input spec, or None for a plain socket.

    Returns one of "INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", DYNAMIC_COMBO.
    """
    if not isinstance(spec, (list, tuple)) or not spec:
        return None
    opts = spec_options(spec)
    if opts.get("forceInput") or opts.get("hidden"):
        return None
    t = spec[0]
    if isinstance(t, (list, tuple)):
        return "COMBO"
    if not isinstance(t, str):
        return None
    if t == "COMBO":
        return "COMBO"
    if t == DYNAMIC_COMBO:
        return DYNAMIC_COMBO
    if t in PLAIN_WIDGET_TYPES:
        return t
    if "," in t:
        wt = opts.get("widgetType")
        if isinstance(wt, str) and wt in PLAIN_WIDGET_TYPES | {"COMBO"}:
            return wt
    return None


def socket_type(spec):
    """The link type of an input spec as the frontend names it ("COMBO" for lists)."""
    if not isinstance(spec, (list, tuple)) or not spec:
        return "*"
    t = spec[0]
    if isinstance(t, (list, tuple)):
        return "COMBO"
    return t if isinstance(t, str) else "*"


def iter_inputs(node_def, sections=("required", "optional")):
    """Yield ``(name, spec, section)`` in the order the frontend lays inputs out."""
    inputs = node_def.get("input") or {}
    order = node_def.get("input_order") or {}
    for section in sections:
        sec = inputs.get(section) or {}
        names = order.get(section)
        if not names:
            names = list(sec)
        seen = set()
        for name in names:
            if name in sec and name not in seen:
                seen.add(name)
                yield name, sec[name], section
        for name in sec:  # anything input_order forgot
            if name not in seen:
                yield name, sec[name], section


def widget_inputs(node_def):
    """Top-level widget inputs ``[(name, spec, section, kind)]`` in order."""
    out = []
    for name, spec, section in iter_inputs(node_def):
        kind = widget_kind(spec)
        if kind is not None:
            out.append((name, spec, section, kind))
    return out


def has_control_widget(name, spec, kind):
    opts = spec_options(spec)
    flag = opts.get("control_after_generate")
    if kind == "INT":
        if flag is None:
            return name in ("seed", "noise_seed")
        return bool(flag)
    if kind == "COMBO":
        return bool(flag)
    return False


def has_upload_widget(spec):
    opts = spec_options(spec)
    return any(k.endswith("_upload") and v for k, v in opts.items())


def _is_control_value(v):
    return v is None or (isinstance(v, str) and v in CONTROL_VALUES)


def _is_upload_value(v):
    return v is None or (isinstance(v, str) and v in UPLOAD_VALUES)


def _dynamic_option(spec, key):
    for o in spec_options(spec).get("options") or []:
        if isinstance(o, dict) and o.get("key") == key:
            return o
    return None


def _walk_widgets(inputs, order, prefix, values, pos, out, slots):
    for section in ("required", "optional"):
        sec = inputs.get(section) or {}
        names = (order or {}).get(section) or list(sec)
        for name in names:
            spec = sec.get(name)
            if spec is None:
                continue
            kind = widget_kind(spec)
            if kind is None:
                continue
            full = prefix + name
            value = _MISSING
            if pos < len(values):
                value = values[pos]
                out[full] = value
                pos += 1
            slots.append((full, spec, section, kind))
            if has_control_widget(name, spec, kind) and pos < len(values) and _is_control_value(values[pos]):
                pos += 1
            if has_upload_widget(spec) and pos < len(values) and _is_upload_value(values[pos]):
                pos += 1
            if kind == DYNAMIC_COMBO:
                key = value if value is not _MISSING else spec_options(spec).get("default")
                if key is _MISSING or key is None:
                    choices = combo_options(spec)
                    key = choices[0] if choices else None
                option = _dynamic_option(spec, key)
                if option is not None:
                    pos = _walk_widgets(option.get("inputs") or {}, None, full + ".", values, pos, out, slots)
    return pos


def map_widget_values(widgets_values, node_def):
    """Match a node's ``widgets_values`` to its widget inputs.

    Returns ``(values, slots, extra)``:
      values -- {input name: value} for each widget input that got a value
                (dynamic-combo children under dotted names);
      slots  -- every widget input walked, ``[(name, spec, section, kind)]``,
                including those left without a value (check ``name in values``);
      extra  -- widget values left over after the walk (should be empty).
    """
    if widgets_values is None:
        widgets_values = []
    if isinstance(widgets_values, dict):
        # Some frontends/extensions save a name -> value mapping.
        slots = []
        _walk_widgets((node_def.get("input") or {}), node_def.get("input_order"), "", [], 0, {}, slots)
        names = {s[0] for s in slots}
        values = {k: v for k, v in widgets_values.items() if k in names}
        extra = [k for k in widgets_values if k not in names]
        return values, slots, extra
    values, slots = {}, []
    pos = _walk_widgets(node_def.get("input") or {}, node_def.get("input_order"), "", list(widgets_values), 0, values, slots)
    return values, slots, list(widgets_values[pos:])


def output_types(node_def):
    out = []
    for t in node_def.get("output") or []:
        out.append("COMBO" if isinstance(t, (list, tuple)) else t)
    return out


def types_compatible(a, b):
    """LiteGraph.isValidConnection: "*"/"" match anything; comma lists intersect."""
    if isinstance(a, (list, tuple)):
        a = "COMBO"
    if isinstance(b, (list, tuple)):
        b = "COMBO"
    a = "" if a is None else str(a)
    b = "" if b is None else str(b)
    if a in ("", "*") or b in ("", "*"):
        return True
    if a.upper() == b.upper():
        return True
    sa = {x.strip().upper() for x in a.split(",") if x.strip()}
    sb = {x.strip().upper() for x in b.split(",") if x.strip()}
    if "*" in sa or "*" in sb:
        return True
    return bool(sa & sb)


# --------------------------------------------------------------------------
# workflow helpers
# --------------------------------------------------------------------------

def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_node_id(v):
    return _is_int(v) or (isinstance(v, str) and v != "")


def parse_links(workflow):
    """{link id: (origin_id, origin_slot, target_id, target_slot, type)}; accepts array or object links.

    Raises ValueError for a link whose ids or slots are not integers (node ids may be strings)."""
    out = {}
    links = workflow.get("links")
    if links is None:
        return out
    if not isinstance(links, list):
        raise ValueError(f"'links' must be a list, got {type(links).__name__}")
    for link in links:
        if isinstance(link, dict):
            fields = tuple(link.get(k) for k in ("id", "origin_id", "origin_slot", "target_id", "target_slot"))
            fields += (link.get("type"),)
        elif isinstance(link, (list, tuple)) and len(link) >= 5:
            fields = tuple(link[:5]) + (link[5] if len(link) > 5 else None,)
        else:
            raise ValueError(f"link {link!r}: expected [id, origin_id, origin_slot, target_id, target_slot, type] "
                             f"or an object with those keys")
        lid, o_id, o_slot, t_id, t_slot, ltype = fields
        if not _is_int(lid) or not _is_node_id(o_id) or not _is_node_id(t_id) or not _is_int(o_slot) \
                or not _is_int(t_slot):
            raise ValueError(f"link {lid!r}: id and slots must be integers and node ids integers or strings, got "
                             f"id={lid!r} origin_id={o_id!r} origin_slot={o_slot!r} target_id={t_id!r} "
                             f"target_slot={t_slot!r}")
        if lid in out:
            raise ValueError(f"link id {lid} appears twice")
        out[lid] = (o_id, o_slot, t_id, t_slot, ltype)
    return out


def _bypass_input_index(node, slot, want_type):
    """ExecutableNodeDTO#getBypassSlotIndex from the frontend."""
    inputs = node.get("inputs") or []
    outputs = node.get("outputs") or []
    out_type = outputs[slot].get("type") if slot < len(outputs) else want_type
    if want_type in (None, "", "*"):
        if not inputs:
            return -1
        return slot if len(inputs) > slot else 0
    if slot < len(inputs):
        t = inputs[slot].get("type")
        if types_compatible(t, out_type) and types_compatible(t, want_type):
            return slot
    for i, inp in enumerate(inputs):
        if inp.get("type") == want_type:
            return i
    for i, inp in enumerate(inputs):
        t = inp.get("type")
        if types_compatible(t, out_type) and types_compatible(t, want_type):
            return i
    return -1


def _resolve(nodes, links, origin_id, origin_slot, want_type, visited=frozenset()):
    """Follow a link back to the real producer (iteratively: Reroute chains may be thousands deep).

    Returns ("link", id, slot), ("value", v), ("drop",) for a muted producer,
    or None when nothing can be resolved (the input is left out).
    Raises ValueError for a cycle.
    """
    seen = set(visited)
    while True:
        key = (str(origin_id), origin_slot)
        if key in seen:
            raise ValueError(f"cycle through node {origin_id} slot {origin_slot} while resolving links")
        seen.add(key)
        node = nodes.get(str(origin_id))
        if node is None:
            return None
        ntype = node.get("type")
        mode = node.get("mode", MODE_ALWAYS)
        if ntype == "PrimitiveNode":
            wv = node.get("widgets_values")
            if isinstance(wv, list) and wv:
                return ("value", wv[0])
            return None
        if ntype in NOTE_TYPES:
            return None
        if ntype == "Reroute":
            inputs = node.get("inputs") or []
            link_id = inputs[0].get("link") if inputs else None
        elif mode == MODE_BYPASS:
            idx = _bypass_input_index(node, origin_slot, want_type)
            if idx < 0:
                return None
            link_id = (node.get("inputs") or [])[idx].get("link")
        elif mode == MODE_NEVER:
            return ("drop",)
        else:
            return ("link", str(origin_id), int(origin_slot))
        if link_id is None or link_id not in links:
            return None
        origin_id, origin_slot = links[link_id][0], links[link_id][1]


def _api_value(v):
    return {"__value__": v} if isinstance(v, list) else v


def _check_nodes(workflow):
    """{str(id): node} after checking what the conversion relies on; ValueError naming the node otherwise."""
    raw = workflow.get("nodes")
    if not isinstance(raw, list):
        raise ValueError(f"'nodes' must be a list, got {type(raw).__name__}")
    nodes = {}
    for i, n in enumerate(raw):
        if not isinstance(n, dict):
            raise ValueError(f"nodes[{i}] must be an object, got {type(n).__name__}")
        nid = n.get("id")
        if not _is_node_id(nid):
            raise ValueError(f"nodes[{i}] ({n.get('type')!r}): 'id' must be an integer or a string, got {nid!r}")
        if str(nid) in nodes:
            raise ValueError(f"node id {nid!r} appears twice (nodes {n.get('type')!r} and "
                             f"{nodes[str(nid)].get('type')!r}); node ids must be unique")
        what = f"node {nid} ({n.get('type')!r})"
        if not isinstance(n.get("type"), str):
            raise ValueError(f"{what}: 'type' must be a string")
        order = n.get("order", 0)
        if not (_is_int(order) or (isinstance(order, float) and order == order and abs(order) != float("inf"))):
            raise ValueError(f"{what}: 'order' must be a number, got {order!r}")
        if not _is_int(n.get("mode", MODE_ALWAYS)):
            raise ValueError(f"{what}: 'mode' must be an integer, got {n.get('mode')!r}")
        wv = n.get("widgets_values")
        if wv is not None and not isinstance(wv, (list, dict)):
            raise ValueError(f"{what}: 'widgets_values' must be a list or an object, got {type(wv).__name__}")
        for key in ("inputs", "outputs"):
            lst = n.get(key)
            if lst is not None and (not isinstance(lst, list) or not all(isinstance(e, dict) for e in lst)):
                raise ValueError(f"{what}: '{key}' must be a list of objects")
        for inp in n.get("inputs") or []:
            link = inp.get("link")
            if link is not None and not _is_int(link):
                raise ValueError(f"{what}: input {inp.get('name')!r} has link {link!r}; expected an integer or null")
        nodes[str(nid)] = n
    return nodes


def workflow_to_prompt(workflow, object_info):
    """Convert a UI-format workflow dict to an API-format prompt dict.

    ``object_info`` is the server's ``/object_info`` answer (node type -> schema).
    Raises ValueError for subgraphs and for node types missing from object_info.
    """
    if not isinstance(workflow, dict) or "nodes" not in workflow:
        raise ValueError("not a UI-format workflow (no 'nodes' list); API-format prompts need no conversion")
    if not isinstance(object_info, dict):
        raise ValueError(f"object_info must be a JSON object (node type -> schema), got {type(object_info).__name__}")
    nodes = _check_nodes(workflow)
    links = parse_links(workflow)
    definitions = workflow.get("definitions") or {}
    subgraph_ids = {s.get("id") for s in ((definitions.get("subgraphs") if isinstance(definitions, dict) else None)
                                          or []) if isinstance(s, dict)}

    unknown = sorted({n.get("type") for n in nodes.values()
                      if n.get("type") not in FRONTEND_ONLY_TYPES and n.get("type") not in object_info
                      and n.get("mode", 0) != MODE_NEVER})
    subgraphs = [t for t in unknown if t in subgraph_ids]
    if subgraphs:
        raise ValueError(f"subgraph nodes are not supported (unpack them first): {subgraphs}")
    if unknown:
        raise ValueError(f"node types not in object_info: {unknown}")

    prompt = {}
    for nid, node in sorted(nodes.items(), key=lambda kv: (kv[1].get("order", 0), _int_or_str(kv[0]))):
        ntype = node.get("type")
        mode = node.get("mode", MODE_ALWAYS)
        if ntype in FRONTEND_ONLY_TYPES or mode in (MODE_NEVER, MODE_BYPASS):
            continue
        node_def = object_info[ntype]
        if not isinstance(node_def, dict):
            raise ValueError(f"object_info[{ntype!r}] must be an object, got {type(node_def).__name__}")
        values, _slots, _extra = map_widget_values(node.get("widgets_values"), node_def)
        inputs = {name: _api_value(v) for name, v in values.items()}
        for inp in node.get("inputs") or []:
            link_id = inp.get("link")
            name = inp.get("name")
            if link_id is None or name is None:
                continue
            if link_id not in links:
                continue
            o_id, o_slot = links[link_id][0], links[link_id][1]
            res = _resolve(nodes, links, o_id, o_slot, inp.get("type"), frozenset())
            if res is None:
                continue
            if res[0] == "value":
                inputs[name] = _api_value(res[1])
            elif res[0] == "drop":
                inputs.pop(name, None)
            else:
                inputs[name] = [res[1], res[2]]
        title = node.get("title") or node_def.get("display_name") or ntype
        prompt[nid] = {"inputs": inputs, "class_type": ntype, "_meta": {"title": title}}

    # Inputs linked to nodes that are not in the prompt are removed (as the frontend does).
    for entry in prompt.values():
        for name in list(entry["inputs"]):
            v = entry["inputs"][name]
            if isinstance(v, list) and len(v) == 2 and v[0] not in prompt:
                del entry["inputs"][name]
    return prompt


def _int_or_str(s):
    try:
        return (0, int(s), "")
    except (TypeError, ValueError):
        return (1, 0, str(s))


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

class CliError(Exception):
    """A problem with the input, reported as one ``error: ...`` line and exit status 2."""


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _duplicate_keys_refused(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def parse_json(data, what):
    """Strict JSON from bytes or text: no BOM, no NaN/Infinity, no duplicate keys; CliError naming `what`."""
    if isinstance(data, bytes):
        if data.startswith(b"\xef\xbb\xbf"):
            raise CliError(f"{what} starts with a UTF-8 byte-order mark (BOM); save it as UTF-8 without BOM")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CliError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if data.startswith("\ufeff"):
        raise CliError(f"{what} starts with a byte-order mark (BOM); save it as UTF-8 without BOM")
    if not data.strip():
        raise CliError(f"{what} is empty")
    try:
        return json.loads(data, parse_constant=_reject_constant, object_pairs_hook=_duplicate_keys_refused)
    except json.JSONDecodeError as e:
        raise CliError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise CliError(f"{what} is nested too deeply to parse") from None
    except ValueError as e:
        raise CliError(f"{what}: {e}") from None


def renamed_workflow(path):
    """The path of the renamed bundled workflow that a path to its old file name stands for, when the old file
    is gone and the renamed one is in the same folder; else None."""
    folder, name = os.path.split(path)
    new = RENAMED_WORKFLOWS.get(name)
    if new is None or os.path.exists(path):
        return None
    new_path = os.path.join(folder, new)
    return new_path if os.path.isfile(new_path) else None


def read_json_file(path, what):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CliError(f"{what} {path!r} does not exist") from None
    except IsADirectoryError:
        raise CliError(f"{what} {path!r} is a directory, not a JSON file") from None
    except OSError as e:
        raise CliError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    return parse_json(data, f"{what} {path!r}")


def _http_json(url, payload=None, timeout=60):
    data = None
    headers = {}
    if payload is not None:
        data = json.dumps(payload).encode("utf-8")
        headers["Content-Type"] = "application/json"
    try:
        req = urllib.request.Request(url, data=data, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        detail = " ".join(e.read().decode("utf-8", "replace").split())
        raise CliError(f"server {url} answered {e.code} {e.reason}: {detail[:2000]}") from None
    except urllib.error.URLError as e:
        raise CliError(f"cannot reach {url}: {e.reason}") from None
    except (OSError, ValueError) as e:  # timeouts, resets, malformed URLs
        raise CliError(f"cannot reach {url}: {e}") from None
    return parse_json(body, f"the answer of {url}")


def load_object_info(path=None, server=None):
    if path:
        info = read_json_file(path, "object_info file")
    elif server:
        info = _http_json(server.rstrip("/") + "/object_info")
    else:
        raise ValueError("need --object-info FILE or --server URL")
    if not isinstance(info, dict):
        raise CliError(f"object_info must be a JSON object (node type -> schema), got {type(info).__name__}")
    return info


def _run(args):
    server = args.server
    if server is None and (args.queue or not args.object_info):
        server = "http://127.0.0.1:8188"

    renamed = renamed_workflow(args.workflow)
    if renamed:
        print(f"note: {args.workflow} was renamed to {os.path.basename(renamed)!r}; converting that", file=sys.stderr)
        args.workflow = renamed
    workflow = read_json_file(args.workflow, "workflow")
    if not isinstance(workflow, dict):
        raise CliError(f"workflow {args.workflow!r} must be a JSON object, got {type(workflow).__name__}")
    object_info = load_object_info(args.object_info, None if args.object_info else server)
    try:
        prompt = workflow_to_prompt(workflow, object_info)
    except ValueError as e:
        raise CliError(f"{args.workflow}: {e}") from None

    text = json.dumps(prompt, indent=2, ensure_ascii=False, allow_nan=False)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise CliError(f"cannot write {args.output!r}: {e.strerror or e}") from None
    elif not args.queue:
        print(text)

    if args.queue:
        body = {"prompt": prompt, "extra_data": {"extra_pnginfo": {"workflow": workflow}}}
        if args.client_id:
            body["client_id"] = args.client_id
        answer = _http_json(server.rstrip("/") + "/prompt", body)
        print(json.dumps(answer, indent=2))
    return 0


def main(argv=None):
    """The command line; every problem is one ``error: ...`` line on stderr and exit status 2."""
    p = argparse.ArgumentParser(description="Convert a ComfyUI UI workflow to an API prompt (and optionally queue it).")
    p.add_argument("workflow", help="UI-format workflow JSON (as saved by the ComfyUI frontend)")
    p.add_argument("--object-info", metavar="FILE", help="saved /object_info JSON (else read from --server)")
    p.add_argument("--server", metavar="URL", default=None,
                   help="ComfyUI server (default http://127.0.0.1:8188 when needed); "
                        "/object_info is read from it unless --object-info is given")
    p.add_argument("--queue", action="store_true", help="POST the prompt to SERVER/prompt")
    p.add_argument("-o", "--output", metavar="FILE", help="write the API prompt here instead of stdout")
    p.add_argument("--client-id", default=None, help="client_id to send with --queue")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except CliError as e:
        message = str(e)
    except RecursionError:
        message = f"{args.workflow}: the workflow is nested too deeply to convert"
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        message = f"{args.workflow}: malformed workflow or object_info ({type(e).__name__}: {e})"
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
