"""The bundled workflows as a new user meets them in ComfyUI's Templates browser, in headless Chromium driven by
Playwright, on both ComfyUI versions with the frontend each pins (stock 0.3.75 with comfyui-frontend-package
1.32.9, stock 0.33.0 with 1.49.6; one server and one browser per version, module-scoped; the pack loaded by the
server's own loader). The server has NO model files (its input/ holds the start image the image-to-video
workflows name), as on a fresh install.

- Cards: Templates -> Extensions -> tiled-attention shows exactly the bundled workflows, each titled with its file
  name in full (not clipped by the card) and showing its own picture: the frontend fetched
  /api/workflow_templates/tiled-attention/<name>.jpg with status 200, the <img> finished loading at the card's
  512x512 and its bytes are workflows/<name>.jpg (a broken picture becomes the frontend's 224 px default and
  fails).
- Downloads: clicking a card on that server lists exactly the workflow's model files, each with its models
  folder and a Download button whose target is the file's URL from the workflow's metadata. Frontend 1.49.6:
  the "errors found" notice -> View details -> the Errors tab's Missing Models group (clicking Download opens
  the URL); 1.32.9: the Missing Models dialog (each Download button's title is the URL; offline, where it cannot
  read the file's size, 1.32.9 opens the file's Hugging Face repository page instead). The LTX-2.3 workflows
  need nodes stock 0.3.75 lacks: not applicable there.

No request leaves the machine: every request to another host is recorded and aborted (that is how the Download
targets are read). Screenshots go to test-artifacts/templates/comfyui-<version>/ (never to docs/).

Needs /usr/bin/chromium and the playwright Python package, as tests/browser/test_browser.py; without them the
tests skip (fail under CI=true).
"""
import glob
import hashlib
import os
import time
import urllib.parse
import urllib.request

import pytest

import workflow_schema as ws
from browser_harness import UI_TIMEOUT_MS, chromium, load_app, load_json, start_server
from tools.comfyui_setup.comfyui import LATEST, OLDEST, ROOT
from tools.demo.frontend_page import INIT_SCRIPT
from tools.template_cards import SIZE as CARD_SIZE

ARTIFACTS = os.path.join(ROOT, "test-artifacts", "templates")
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json")))
IDS = [os.path.basename(p)[:-5] for p in WORKFLOWS]
MODULE = "tiled-attention"  # the folder name ComfyServer gives this repository in custom_nodes
VIEWPORT = {"width": 1280, "height": 800}  # a laptop screen, and what the README's screenshots show
CARDS_VIEWPORT = {"width": 1440, "height": 1250}  # the ten cards in three rows of the Templates browser
JS_STORES = "document.querySelector('#vue-app').__vue_app__.config.globalProperties.$pinia._s"

# each card as shown: its test id, title, whether the title is clipped, and its picture (bytes hashed in the page)
JS_CARDS = """async () => {
    const out = [];
    for (const card of document.querySelectorAll('[data-testid^="template-workflow-"]')) {
        const h = card.querySelector('h3'), img = card.querySelector('img');
        let sha = null;
        if (img && img.complete && img.naturalWidth) {
            const bytes = await (await fetch(img.src)).arrayBuffer();
            sha = [...new Uint8Array(await crypto.subtle.digest('SHA-256', bytes))]
                .map(b => b.toString(16).padStart(2, '0')).join('');
        }
        out.push({id: card.getAttribute('data-testid').slice('template-workflow-'.length),
                  title: h ? h.textContent.trim() : null,
                  clipped: h ? (h.scrollHeight > h.clientHeight + 1 || h.scrollWidth > h.clientWidth + 1) : null,
                  src: img ? img.src : null, width: img ? img.naturalWidth : 0, height: img ? img.naturalHeight : 0,
                  complete: img ? img.complete : false, sha});
    }
    return out;
}"""

JS_CARDS_LOADED = """(n) => {
    const imgs = [...document.querySelectorAll('[data-testid^="template-workflow-"] img')];
    return imgs.length === n && imgs.every(i => i.complete && i.naturalWidth > 0);
}"""

# frontend 1.49.6: the rows of the Errors tab's Missing Models group
JS_PANEL_ROWS = """() => [...document.querySelectorAll(
        '[data-testid="error-group-missing-model"] [data-testid="missing-model-download"]')].map(b => {
    const row = b.closest('.min-h-8') || b.parentElement;
    return {name: row.querySelector('button[title]')?.getAttribute('title') ?? null,
            folder: row.querySelector('span.block')?.textContent.trim() ?? null,
            label: b.getAttribute('aria-label'), text: b.textContent.trim()};
})"""

JS_CANDIDATES = """() => %s.get('missingModel').missingModelCandidates.map(c =>
    ({name: c.name, directory: c.directory, url: c.url ?? null, missing: c.isMissing}))""" % JS_STORES

# frontend 1.32.9: the Missing Models dialog
JS_DIALOG = """() => %s.get('dialog').dialogStack.map(d => ({key: d.key,
    models: d.contentProps?.missingModels ? JSON.parse(JSON.stringify(d.contentProps.missingModels)) : null}))""" \
    % JS_STORES
JS_DIALOG_ROWS = """() => [...document.querySelectorAll('.comfy-missing-models li')].map(li => ({
    text: li.querySelector('span[title]')?.textContent.trim() ?? null,
    download: [...li.querySelectorAll('button')].filter(b => b.textContent.trim().startsWith('Download'))
        .map(b => b.getAttribute('title'))}))"""

# the view fitted to the loader nodes (the ones the frontend outlines in red), in the canvas left of the panel
JS_FIT_LOADERS = """(right) => {
    const c = app.canvas, pad = 40, top = 80, left = 70;
    const b = app.graph._nodes.filter(n => n.properties?.models?.length).map(n => n.boundingRect);
    const x0 = Math.min(...b.map(r => r[0])), x1 = Math.max(...b.map(r => r[0] + r[2]));
    const y0 = Math.min(...b.map(r => r[1])), y1 = Math.max(...b.map(r => r[1] + r[3]));
    const w = right - left - 2 * pad, h = c.canvas.clientHeight - top - 2 * pad;
    const scale = Math.min(w / (x1 - x0), h / (y1 - y0), 1);
    c.ds.scale = scale;
    c.ds.offset[0] = (left + pad) / scale + (w / scale - (x1 - x0)) / 2 - x0;
    c.ds.offset[1] = (top + pad) / scale + (h / scale - (y1 - y0)) / 2 - y0;
    c.setDirty(true, true);
    return scale;
}"""
PANEL_WIDTH = 500  # the Errors panel widened by its splitter, as a user would, so file names fit on one line

JS_ACTIVE = """() => { const w = %s.get('workflow').activeWorkflow;
    return {name: w?.filename ?? null, new: w !== window.__testBefore, nodes: app.graph._nodes.length}; }""" % JS_STORES


def _expected_files(wf, object_info):
    """{file name: (models folder, download URL)} of every model file the workflow's loaders load: the name from
    the loader's widget, the folder the loader reads it from, the URL from the node's properties.models (None
    where a node lacks it: then the frontend can offer no download and the comparison fails)."""
    out = {}
    for node in wf["nodes"]:
        if node["type"] not in object_info:
            continue
        values, _slots, _extra = ws.wapi.map_widget_values(node.get("widgets_values"), object_info[node["type"]])
        urls = {e["name"]: e["url"] for e in (node.get("properties") or {}).get("models") or []}
        for inp, value in values.items():
            if isinstance(value, str) and value.endswith(".safetensors"):
                out[value] = (ws.LOADER_FOLDERS[(node["type"], inp)], urls.get(value))
    return out


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _hf_repo_page(url):
    """What frontend 1.32.9 opens instead of a Hugging Face file it could not reach: the repository's page."""
    path = urllib.parse.urlsplit(url).path
    return "https://huggingface.co/" + path.split("/resolve/")[0].lstrip("/")


@pytest.fixture(scope="module", params=[OLDEST, LATEST], ids=[f"comfyui-{v}" for v in (OLDEST, LATEST)])
def server(request, tmp_path_factory):
    """A stock ComfyUI of one version with this pack, the frontend it pins, no model files at all, and the
    frontend's first-run popups off."""
    version = request.param

    def start_images(srv):  # the start image of the image-to-video workflows: not what is tested
        from PIL import Image
        inputs = os.path.join(srv.base, "input")
        os.makedirs(inputs, exist_ok=True)
        for wf in map(load_json, WORKFLOWS):
            for node in wf["nodes"]:
                if node["type"] == "LoadImage":
                    Image.new("RGB", (64, 64), (90, 120, 200)).save(os.path.join(inputs, node["widgets_values"][0]))

    srv = start_server(version, tmp_path_factory.mktemp(f"comfy-templates-{version}"), prepare=start_images)
    srv.artifacts = os.path.join(ARTIFACTS, f"comfyui-{version}")
    assert not any(f for _d, _s, f in os.walk(os.path.join(srv.base, "models"))), "the server must start without model files"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info")


@pytest.fixture(scope="module")
def page(server):
    os.makedirs(server.artifacts, exist_ok=True)
    external, responses = [], []

    def elsewhere(route):
        external.append((route.request.method, route.request.url))
        route.abort()

    with chromium(VIEWPORT, INIT_SCRIPT, os.path.join(server.artifacts, "console.log")) as (ctx, pg):
        ctx.route(lambda url: not url.startswith(server.url) and not url.startswith(("data:", "blob:")), elsewhere)
        pg.on("response", lambda r: responses.append((r.url, r.status, r.headers.get("content-type"))))
        pg.external, pg.responses = external, responses
        pg.version, pg.artifacts, pg.server = server.version, server.artifacts, server
        load_app(pg, server.url, os.path.join(server.artifacts, "startup-failure.png"))
        yield pg


# ---- helpers --------------------------------------------------------------------------------------------

def _open_pack_templates(pg):
    _close_dialogs(pg)  # whatever an earlier test left open
    if pg.version == LATEST:  # an Errors panel left open by an earlier test
        pg.evaluate(f"() => {{ {JS_STORES}.get('rightSidePanel').isOpen = false; }}")
    pg.locator(".templates-tab-button").click(timeout=UI_TIMEOUT_MS)  # the side bar's Templates button
    pg.wait_for_selector('[data-testid="template-workflows-content"]', timeout=UI_TIMEOUT_MS)
    pg.get_by_text(MODULE, exact=True).first.click(timeout=UI_TIMEOUT_MS)  # Extensions > the pack's folder
    pg.locator(f'[data-testid="template-workflow-{IDS[0]}"]').wait_for(state="visible", timeout=UI_TIMEOUT_MS)


def _dialog_box(pg):
    """The templates dialog's rectangle, for a screenshot of it alone."""
    return pg.evaluate("""() => { const c = document.querySelector('[data-testid="template-workflows-content"]');
        const r = (c.closest('[role="dialog"]') || c.closest('.p-dialog')).getBoundingClientRect();
        return {x: r.x, y: r.y, width: r.width, height: r.height}; }""")


def _open_card(pg, name):
    pg.evaluate(f"() => {{ window.__testBefore = {JS_STORES}.get('workflow').activeWorkflow; }}")
    _open_pack_templates(pg)
    pg.locator(f'[data-testid="template-workflow-{name}"]').click(timeout=UI_TIMEOUT_MS)
    deadline = time.time() + UI_TIMEOUT_MS / 1000
    while time.time() < deadline:
        active = pg.evaluate(JS_ACTIVE)
        if active["new"] and active["name"] == name:
            return
        pg.wait_for_timeout(150)
    raise AssertionError(f"{name} did not open from its card: {pg.evaluate(JS_ACTIVE)}\n" + "\n".join(pg.console[-30:]))


def _wait_external(pg, url, accept, timeout_s=15):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        hits = [u for m, u in pg.external if m == "GET" and u in accept]
        if hits:
            return hits[0]
        pg.wait_for_timeout(150)
    raise AssertionError(f"Download for {url} requested none of {sorted(accept)}; requests: {pg.external[-10:]}")


def _close_dialogs(pg):
    """Close what the dialog store holds (frontend 1.32.9's templates dialog does not take Escape) and wait
    until no dialog mask is left over the page."""
    pg.evaluate(f"""() => {{ const d = {JS_STORES}.get('dialog');
        for (const x of [...d.dialogStack]) d.closeDialog({{key: x.key}}); }}""")
    pg.wait_for_function(f"() => {JS_STORES}.get('dialog').dialogStack.length === 0 && "
                         "!document.querySelector('.p-dialog-mask')", timeout=UI_TIMEOUT_MS)


def _close_popups(pg):
    for other in pg.context.pages:
        if other is not pg:
            other.close()


# ---- tests ----------------------------------------------------------------------------------------------

def test_server_serves_each_card(server):
    assert sorted(server.get("/api/workflow_templates").get(MODULE, [])) == IDS
    for name in IDS:
        url = f"{server.url}/api/workflow_templates/{MODULE}/{urllib.parse.quote(name)}.jpg"
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.headers.get_content_type() == "image/jpeg", (name, r.headers.get_content_type())
            assert r.read() == open(os.path.join(ROOT, "workflows", name + ".jpg"), "rb").read(), name


def test_templates_browser_shows_every_card_with_its_picture(page):
    page.responses.clear()
    page.set_viewport_size(CARDS_VIEWPORT)
    try:
        _open_pack_templates(page)
        try:
            page.wait_for_function(JS_CARDS_LOADED, arg=len(IDS), timeout=UI_TIMEOUT_MS)
        finally:
            page.screenshot(path=os.path.join(page.artifacts, "templates-cards-page.png"))
        cards = page.evaluate(JS_CARDS)
        page.wait_for_timeout(300)
        page.screenshot(path=os.path.join(page.artifacts, "templates-cards.png"), clip=_dialog_box(page))
    finally:
        page.set_viewport_size(VIEWPORT)
    assert sorted(c["id"] for c in cards) == IDS, [c["id"] for c in cards]
    fetched = {u: (s, t) for u, s, t in page.responses}
    for card in cards:
        name = card["id"]
        assert card["title"] == name, card
        assert not card["clipped"], f"the card clips its title {name!r}"
        url = f"{page.server.url}/api/workflow_templates/{MODULE}/{urllib.parse.quote(name)}.jpg"
        assert fetched.get(url, (None,))[0] == 200, f"{name}: the frontend did not get {url}: {fetched.get(url)}"
        assert "default-template" not in card["src"], f"{name}: the frontend's default picture {card}"
        assert card["complete"] and (card["width"], card["height"]) == (CARD_SIZE, CARD_SIZE), card
        assert card["sha"] == _sha256(os.path.join(ROOT, "workflows", name + ".jpg")), \
            f"{name}: the card shows another picture than workflows/{name}.jpg"
    _close_dialogs(page)


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_opening_a_card_without_the_models_lists_them_for_download(page, object_info, path):
    name = os.path.basename(path)[:-5]
    wf = load_json(path)
    lacking = {n["type"] for n in wf["nodes"] if n["type"] not in object_info and "Note" not in n["type"]}
    if lacking:
        pytest.skip(f"not applicable: stock ComfyUI {page.version} lacks {sorted(lacking)} used by {name}")
    want = _expected_files(wf, object_info)
    assert want, f"{name} loads no model file"
    page.external.clear()
    _open_card(page, name)
    if page.version == LATEST:
        _check_errors_panel(page, name, want)
    else:
        _check_missing_models_dialog(page, name, want)
    _close_popups(page)


def _check_errors_panel(pg, name, want):
    """Frontend 1.49.6: the notice, its View details, the Missing Models group of the Errors tab."""
    pg.get_by_role("button", name="View details").click(timeout=UI_TIMEOUT_MS)
    group = pg.locator('[data-testid="error-group-missing-model"]')
    group.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    pg.wait_for_function(f"() => ({JS_PANEL_ROWS})().length > 0", timeout=UI_TIMEOUT_MS)
    pg.wait_for_timeout(1000)  # every row rendered (they come from one store update)
    _widen_panel_and_show_loaders(pg)
    pg.screenshot(path=os.path.join(pg.artifacts, f"missing-models-{name}.png"))
    rows = pg.evaluate(JS_PANEL_ROWS)
    shown = sorted((r["name"], r["folder"]) for r in rows)
    assert shown == sorted((n, d) for n, (d, _u) in want.items()), f"{name}: the panel lists {rows}"
    assert all(r["text"] == "Download" and r["label"] == f"Download {r['name']}" for r in rows), rows
    candidates = pg.evaluate(JS_CANDIDATES)
    assert {(c["name"], c["directory"], c["url"]) for c in candidates} == \
        {(n, d, u) for n, (d, u) in want.items()} and all(c["missing"] for c in candidates), candidates
    for row in rows:
        pg.external.clear()
        pg.locator(f'[data-testid="missing-model-download"][aria-label="Download {row["name"]}"]').click()
        url = want[row["name"]][1]
        assert _wait_external(pg, url, {url}) == url


def _widen_panel_and_show_loaders(pg):
    """For a screenshot a person can read: the panel dragged wider by its splitter, the canvas on the loaders."""
    gutter = pg.locator(".p-splitter-gutter").last.bounding_box()
    if gutter:
        y = gutter["y"] + gutter["height"] / 2
        pg.mouse.move(gutter["x"] + gutter["width"] / 2, y)
        pg.mouse.down()
        pg.mouse.move(VIEWPORT["width"] - PANEL_WIDTH, y, steps=8)
        pg.mouse.up()
        pg.mouse.move(VIEWPORT["width"] // 3, VIEWPORT["height"] // 2)  # off the splitter: no hover colour
        pg.wait_for_timeout(300)
        gutter = pg.locator(".p-splitter-gutter").last.bounding_box()
    pg.evaluate(JS_FIT_LOADERS, gutter["x"] if gutter else VIEWPORT["width"])
    pg.wait_for_timeout(500)


def _check_missing_models_dialog(pg, name, want):
    """Frontend 1.32.9: the Missing Models dialog."""
    pg.wait_for_function(f"() => ({JS_DIALOG_ROWS})().length > 0", timeout=UI_TIMEOUT_MS)
    pg.wait_for_timeout(1000)  # every row rendered (they come from one dialog's props)
    pg.screenshot(path=os.path.join(pg.artifacts, f"missing-models-{name}.png"))
    dialogs = pg.evaluate(JS_DIALOG)
    assert [d["key"] for d in dialogs] == ["global-missing-models-warning"], dialogs
    assert {m["name"]: (m["directory"], m["url"]) for m in dialogs[0]["models"]} == want, dialogs
    rows = pg.evaluate(JS_DIALOG_ROWS)
    assert sorted(r["text"] for r in rows) == sorted(f"{d} / {n}" for n, (d, _u) in want.items()), rows
    for row in rows:
        directory, _, file_name = row["text"].partition(" / ")
        url = want[file_name][1]
        assert row["download"] == [url], f"{name}: {row}"
        pg.external.clear()
        pg.locator(f'.comfy-missing-models button[title="{url}"]').click()
        _wait_external(pg, url, {url, _hf_repo_page(url)})
    _close_dialogs(pg)
