"""The nodes' widget contract, as ComfyUI serves it in /object_info (GET_NODE_INFO_V1 of each V3 node from the
pack's comfy_entrypoint): every input's type, order, default, range, step and choices, and the output types, against
the snapshot tests/comfy/node_schemas.json. Saved workflows store widget values by position and the front end
clamps them to these ranges, so a changed default, bound or choice changes what users' graphs run: change the
snapshot on purpose (`python tests/comfy/test_node_schemas.py --print > tests/comfy/node_schemas.json`, from the
repository root with ComfyUI importable), never by accident. Tooltips and descriptions are left out (wording)."""
import asyncio
import json
import os
import sys

import pytest

pytestmark = pytest.mark.comfy_inprocess

SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_schemas.json")
KEYS = ("default", "min", "max", "step", "options", "multiselect", "round", "display", "multiline",
        "forceInput", "lazy", "rawLink")


def contract(info: dict) -> dict:
    """The parts of one node's V1 info that saved workflows and the front end depend on."""
    inputs = {}
    for group in ("required", "optional"):
        for name, spec in info["input"].get(group, {}).items():
            kind, opts = (spec[0], spec[1] if len(spec) > 1 else {})
            if isinstance(kind, list):  # an old-style combo: the choices are the type
                kind, opts = "COMBO", dict(opts, options=kind)
            inputs[name] = {"group": group, "type": kind, **{k: opts[k] for k in KEYS if k in opts}}
    # output types only: ComfyUI 0.3.75 serves neither the outputs' display names nor output_node as 0.33.0 does
    return {"category": info["category"],
            "input_order": {g: list(v) for g, v in info["input_order"].items() if g != "hidden"},
            "inputs": inputs, "outputs": list(info["output"])}


def node_contracts(pack) -> dict:
    extension = asyncio.run(pack.comfy_entrypoint())
    out = {}
    for cls in asyncio.run(extension.get_node_list()):
        info = cls.GET_NODE_INFO_V1()
        out[info["name"]] = contract(info)
    return json.loads(json.dumps(out))  # tuples as lists, as in the snapshot


def test_every_nodes_widgets_match_the_snapshot(pack):
    with open(SNAPSHOT) as f:
        want = json.load(f)
    got = node_contracts(pack)
    assert sorted(got) == sorted(want), "nodes added or removed: update tests/comfy/node_schemas.json on purpose"
    for node in want:
        assert got[node] == want[node], (
            f"{node}: its widgets changed (see the module docstring to update the snapshot on purpose)\n"
            f"now:      {json.dumps(got[node], sort_keys=True)}\nsnapshot: {json.dumps(want[node], sort_keys=True)}")


if __name__ == "__main__" and "--print" in sys.argv:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.join(here, "..", "support"), os.path.join(here, "..", "..")]
    from comfy_harness import load_pack
    print(json.dumps(node_contracts(load_pack()), indent=1, sort_keys=True))
