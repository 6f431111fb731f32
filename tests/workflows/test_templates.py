"""The bundled workflows as ComfyUI templates: one-click model downloads, template cards and names.

- Model metadata: every loader widget that names a model file carries a `properties.models` entry on its node
  ({name, url, directory}, the convention of ComfyUI's official templates, which the frontend turns into its
  missing-models list with a Download button); each URL is https and ends in that file's name; each entry is the
  one ComfyUI's official templates give for that file (the comfyui_workflow_templates_json package the pinned
  ComfyUI 0.33.0 installs), so no URL is made up; the note's file list says the same.
- Cards: tools/template_cards.py draws workflows/<name>.jpg from each workflow's own data; drawn again here they
  must match the committed ones, every workflow has one and no card is left without a workflow.
- Names: each file is named as its data says (the Templates browser shows the file name as the title), in
  characters that survive URLs, git and Windows; the old file names still convert with tools/workflow_api.py.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse

import pytest

import live_schema
import workflow_schema as ws
from comfy_harness import missing
from tools import template_cards as cards
from tools.workflow_facts import template_title, workflow_facts

wapi = ws.wapi
ROOT = ws.ROOT
WORKFLOW_DIR = os.path.join(ROOT, "workflows")
WORKFLOWS = sorted(glob.glob(os.path.join(WORKFLOW_DIR, "*.json")))
IDS = [os.path.basename(p)[:-5] for p in WORKFLOWS]
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 .\-]*[A-Za-z0-9p]$")
# what each bundled workflow makes, by hand from the README's table: the facts the cards are drawn from
EXPECTED_FACTS = {
    "Wan 2.2 5B Text to Video 480p": ("Wan 2.2 TI2V 5B", "Text to Video", False, 832, 480, 41, 24.0),
    "Wan 2.2 5B Text to Video 720p": ("Wan 2.2 TI2V 5B", "Text to Video", False, 1280, 720, 121, 24.0),
    "Wan 2.2 5B Image to Video 480p": ("Wan 2.2 TI2V 5B", "Image to Video", False, 832, 480, 41, 24.0),
    "LTX-2.3 Text to Video 720p": ("LTX-2.3 22B", "Text to Video", True, 1280, 704, 129, 25.0),
    "LTX-2.3 Image to Video 720p": ("LTX-2.3 22B", "Image to Video", True, 1280, 704, 129, 25.0),
    "LTX-2.3 Text to Video 1080p": ("LTX-2.3 22B", "Text to Video", True, 1920, 1080, 129, 25.0),
    "Wan 2.2 14B Text to Video 480p": ("Wan 2.2 A14B", "Text to Video", False, 832, 480, 81, 16.0),
    "Wan 2.2 14B Image to Video 480p": ("Wan 2.2 A14B", "Image to Video", False, 832, 480, 81, 16.0),
    "Z-Image Turbo Image 1024x1024": ("Z-Image Turbo 6B", "Text to Image", False, 1024, 1024, 1, 0.0),
    "Z-Image Turbo Image 1536x1536": ("Z-Image Turbo 6B", "Text to Image", False, 1536, 1536, 1, 0.0),
}
NOTE_FILE_LINE = re.compile(r"^- `([^`]+)` \u2192 `([a-z_]+)/` \u2014 (https://\S+)")


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def oi_new():
    return live_schema.object_info_or_skip("0.33.0")[0]


def loader_files(wf, object_info):
    """(node, input name, file name, models folder) of every loader widget that names a model file, the widget
    values matched to inputs by the live schema."""
    out = []
    for node in wf["nodes"]:
        if node["type"] in ws.FRONTEND_ONLY_TYPES:
            continue
        values, _slots, _extra = wapi.map_widget_values(node.get("widgets_values"), object_info[node["type"]])
        for inp, value in values.items():
            if isinstance(value, str) and value.endswith(".safetensors"):
                key = (node["type"], inp)
                assert key in ws.LOADER_FOLDERS, f"node {node['id']} loads {value} by {key}: a loader this test lacks"
                out.append((node, inp, value, ws.LOADER_FOLDERS[key]))
    return out


def metadata(wf):
    """{file name: (url, directory)} over every node's properties.models; a file with two entries that differ
    fails."""
    found = {}
    for node in wf["nodes"]:
        for entry in (node.get("properties") or {}).get("models") or []:
            assert set(entry) == {"name", "url", "directory"}, (node["id"], entry)
            value = (entry["url"], entry["directory"])
            assert found.setdefault(entry["name"], value) == value, f"{entry['name']}: two different entries"
    return found


def note_files(wf):
    notes = [n["widgets_values"][0] for n in wf["nodes"] if n["type"] in ws.NOTE_TYPES]
    files = {}
    for line in "\n".join(notes).splitlines():
        m = NOTE_FILE_LINE.match(line)
        if m:
            files[m.group(1)] = (m.group(3), m.group(2))
    return files


def official_models():
    """{file name: {(url, directory)}} from every template ComfyUI's official template package holds."""
    try:
        import comfyui_workflow_templates_json
    except ImportError:
        missing("the comfyui-workflow-templates-json package (pinned in tests/requirements-test.txt) is absent")
    root = os.path.join(os.path.dirname(comfyui_workflow_templates_json.__file__), "templates")
    found = {}

    def walk(graph):
        for node in graph.get("nodes") or []:
            for entry in (node.get("properties") or {}).get("models") or []:
                found.setdefault(entry.get("name"), set()).add((entry.get("url"), entry.get("directory")))
        for sub in (graph.get("definitions") or {}).get("subgraphs") or []:
            walk(sub)

    paths = glob.glob(os.path.join(root, "*.json"))
    assert len(paths) > 100, f"{root} holds {len(paths)} templates"
    for path in paths:
        graph = load(path)
        if isinstance(graph, dict):
            walk(graph)
    return found


# --------------------------------------------------------------------------
# one-click model downloads
# --------------------------------------------------------------------------

@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_every_loader_file_has_download_metadata_on_its_node(path, oi_new):
    wf = load(path)
    files = loader_files(wf, oi_new)
    assert files, "no model loader"
    for node, inp, name, folder in files:
        entries = {e["name"]: e for e in node["properties"].get("models") or []}
        assert name in entries, f"node {node['id']} ({node['type']}) loads {name} without properties.models"
        assert entries[name]["directory"] == folder, (node["type"], inp, entries[name])
    for node in wf["nodes"]:  # and no entry for a file the node does not load
        loads = {v for v in node.get("widgets_values") or [] if isinstance(v, str)}
        for entry in (node.get("properties") or {}).get("models") or []:
            assert entry["name"] in loads, f"node {node['id']} ({node['type']}) lists {entry['name']}, loads {loads}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_download_urls_are_https_and_name_the_file(path):
    for name, (url, _directory) in metadata(load(path)).items():
        parts = urllib.parse.urlsplit(url)
        assert parts.scheme == "https" and parts.netloc, url
        assert not parts.query and not parts.fragment, url
        assert urllib.parse.unquote(parts.path.rsplit("/", 1)[-1]) == name, f"{url} does not end in {name}"


def test_download_metadata_is_what_comfyuis_official_templates_give():
    official = official_models()
    for path in WORKFLOWS:
        for name, entry in metadata(load(path)).items():
            assert name in official, f"{os.path.basename(path)}: {name} is in no official ComfyUI template"
            assert entry in official[name], \
                f"{os.path.basename(path)}: {name} -> {entry}; the official templates give {sorted(official[name])}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_note_and_download_metadata_agree(path, oi_new):
    wf = load(path)
    in_note, in_metadata = note_files(wf), metadata(wf)
    assert in_note == in_metadata, f"note lists {in_note}\nmetadata says {in_metadata}"
    assert in_metadata.keys() == {name for _n, _i, name, _f in loader_files(wf, oi_new)}


# --------------------------------------------------------------------------
# names and cards
# --------------------------------------------------------------------------

def test_workflow_facts_read_from_the_graphs():
    got = {}
    for path in WORKFLOWS:
        f = workflow_facts(load(path))
        got[os.path.basename(path)[:-5]] = (f.model_long, f.task, f.audio, f.width, f.height, f.frames, f.fps)
    assert got == EXPECTED_FACTS


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_file_name_is_the_title_its_data_gives(path):
    name = os.path.basename(path)[:-5]
    assert name == template_title(workflow_facts(load(path)))
    # unescaped in the frontend's template URLs, git paths, zip archives and Windows file names
    assert SAFE_NAME.match(name) and "  " not in name, name


def test_cards_drawn_again_match_the_committed_ones(tmp_path):
    drawn = cards.write_cards(str(tmp_path))
    assert sorted(os.path.basename(p) for p in drawn) == sorted(i + ".jpg" for i in IDS)
    assert cards.differing(str(tmp_path), WORKFLOW_DIR) == []
    for path in drawn:
        with open(os.path.join(WORKFLOW_DIR, os.path.basename(path)), "rb") as f:
            assert f.read(3) == b"\xff\xd8\xff", "not a JPEG"


def test_a_changed_workflow_gets_a_different_card_and_name(tmp_path):
    """The cards and titles follow the data: a workflow made 720p in a copy no longer matches its card or name,
    and a card without its workflow is reported."""
    wdir = tmp_path / "workflows"
    shutil.copytree(WORKFLOW_DIR, wdir)
    name = "Wan 2.2 5B Text to Video 480p"
    wf = load(wdir / f"{name}.json")
    (latent,) = [n for n in wf["nodes"] if n["type"] == "Wan22ImageToVideoLatent"]
    latent["widgets_values"][:3] = [1280, 720, 41]
    (wdir / f"{name}.json").write_text(json.dumps(wf), encoding="utf-8")
    os.remove(wdir / "LTX-2.3 Text to Video 1080p.json")
    out = tmp_path / "cards"
    cards.write_cards(str(out), str(wdir))
    problems = cards.differing(str(out), str(wdir))
    assert sorted(p.split(":")[0] for p in problems) == ["LTX-2.3 Text to Video 1080p.jpg", f"{name}.jpg"], problems
    assert cards.misnamed(str(wdir)) == [(f"{name}.json", "Wan 2.2 5B Text to Video 720p.json")]


def test_card_tool_check_mode_passes_on_the_committed_cards():
    out = subprocess.run([sys.executable, "-m", "tools.template_cards", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_old_file_names_still_convert(tmp_path):
    renamed = wapi.RENAMED_WORKFLOWS
    # the six workflows that had other names once (the Wan 14B and Z-Image ones never had)
    assert set(renamed.values()) == {os.path.basename(p) for p in WORKFLOWS
                                     if not os.path.basename(p).startswith(("Wan 2.2 14B", "Z-Image"))}
    for old, new in renamed.items():
        assert wapi.renamed_workflow(os.path.join(WORKFLOW_DIR, old)) == os.path.join(WORKFLOW_DIR, new)
        assert not os.path.exists(os.path.join(WORKFLOW_DIR, old))
    assert wapi.renamed_workflow(os.path.join(WORKFLOW_DIR, "no_such_workflow.json")) is None
    # the README's headless example with the old path a user may have kept in a script: the same prompt
    info, _source, _pack = live_schema.object_info_or_skip("0.33.0")
    oi_path = tmp_path / "object_info.json"
    oi_path.write_text(json.dumps(info))
    old = os.path.join(WORKFLOW_DIR, "wan22_5b_t2v_480p.json")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "workflow_api.py"), old,
                          "--object-info", str(oi_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "was renamed to 'Wan 2.2 5B Text to Video 480p.json'; converting that" in out.stderr, out.stderr
    new = load(os.path.join(WORKFLOW_DIR, "Wan 2.2 5B Text to Video 480p.json"))
    assert json.loads(out.stdout) == wapi.workflow_to_prompt(new, info)


def test_readme_names_every_workflow_and_shows_the_template_screenshots():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for name in IDS:
        assert f"| `{name}` |" in readme, f"README's Bundled workflows table lacks {name}"
    for shot in ("docs/templates-cards.png", "docs/missing-models-download.png"):
        assert f"]({shot})" in readme and os.path.isfile(os.path.join(ROOT, shot)), shot
