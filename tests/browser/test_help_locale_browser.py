"""The pack's help pages and translations in the real ComfyUI frontend, in headless Chromium driven by Playwright, on
both ComfyUIs with the frontend each pins: stock 0.3.75 with 1.32.9 and stock 0.33.0 with 1.49.6 (one server and one
browser per version, module-scoped; the pack loaded by the server's own loader, with one other pack in custom_nodes:
a one-node pack written here that ships its own ja and ru translation, as any translated pack does).

- Help page, English: Patch Attention (tiled) on the canvas, selected with a real click, then the selection
  toolbox's info button (`data-testid="info-button"`: 1.49.6 shows the page in the properties panel's Info tab,
  1.32.9 in the node library sidebar); and from the node library: 1.32.9's help button on the node's row; 1.49.6's
  default library (its "New Node Library Design") has no help button, so the test checks that and then opens the
  page from the classic library, which that setting brings back. The panel must show web/docs/TiledAttentionPatch.md
  (its title, a sentence only the page has, and a list item of every input), not the frontend's fallback (the node's
  description).
- Languages: the frontend's Comfy.Locale set to ja and to ru (saved through /settings before the page loads, as the
  settings dialog does), in both frontends: the node's title, every widget label and the model input's label in that
  language, the tooltip shown on hovering the memory_budget_mb widget, the node library's row and category; and the
  help page in that language (web/docs/<node id>/<lang>.md). Frontend 1.32.9 drops the custom nodes' translations
  when it loads a language (fixed upstream in ComfyUI_frontend PR #7214, which 1.49.6 has); the pack's
  web/js/keep_translations.js restores the pack's own. So the test also checks, per frontend, that the script acted
  exactly where the frontend needs it (its marker <html data-tiled-attention-restored-locales> names the language on
  1.32.9 and is absent on 1.49.6); that with the script disabled (the frontend's Comfy.Extension.Disabled) 1.32.9
  shows the pack's node in English and 1.49.6 still translated; that the other pack's node is left as the frontend
  shows it (English on 1.32.9, translated on 1.49.6); and that after switching the language in the running app
  (ja, then ru through the frontend's settings API, as the settings dialog does) a new node's labels and tooltip are
  in the new language.

Screenshots go to test-artifacts/browser-help-locale/comfyui-<version>/ (never to docs/). Needs /usr/bin/chromium
and the playwright package as tests/browser/test_browser.py does; without them the tests skip (fail under CI=true).
"""
import json
import os
import re
import time

import pytest

from browser_harness import UI_TIMEOUT_MS, chromium, load_app, load_json, post_json, start_server
from tools.comfyui_setup.comfyui import LATEST, OLDEST, ROOT
from tools.demo.frontend_page import INIT_SCRIPT, VIEWPORT

ARTIFACTS = os.path.join(ROOT, "test-artifacts", "browser-help-locale")
NODE = "TiledAttentionPatch"
DISPLAY = "Patch Attention (tiled)"
TOOLTIP_WIDGET = "memory_budget_mb"
LANGS = ("ja", "ru")
JS_STORES = "document.querySelector('#vue-app').__vue_app__.config.globalProperties"
# the app starts on an empty graph (the workflow it restores from localStorage) instead of its default one, whose
# missing model files would put an error overlay over the screenshots
EMPTY_GRAPH = {"last_node_id": 0, "last_link_id": 0, "nodes": [], "links": [], "groups": [], "config": {}, "extra": {},
               "version": 0.4}
START_EMPTY = ("if (!localStorage.getItem('workflow')) "
               f"localStorage.setItem('workflow', {json.dumps(json.dumps(EMPTY_GRAPH))})")

# one fresh Patch Attention (tiled) node at a known place and zoom
JS_ONE_NODE = """(type) => {
    app.graph.clear();
    const n = LiteGraph.createNode(type);
    n.pos = [560, 260];
    app.graph.add(n);
    app.canvas.ds.scale = 1.5; app.canvas.ds.offset[0] = 0; app.canvas.ds.offset[1] = 0;
    app.canvas.setDirty(true, true); app.canvas.draw(true, true);
}"""

# the screen points of the node's title and of the centre of one widget (the canvas' own transform:
# screen = canvas rect + (graph + offset) * scale)
JS_POINTS = """(widget) => {
    const n = app.graph._nodes[0], ds = app.canvas.ds, r = app.canvas.canvas.getBoundingClientRect();
    const at = (x, y) => [r.left + (x + ds.offset[0]) * ds.scale, r.top + (y + ds.offset[1]) * ds.scale];
    const w = n.widgets.find(w => w.name === widget);
    return {title: at(n.pos[0] + 40, n.pos[1] - LiteGraph.NODE_TITLE_HEIGHT / 2),
            widget: at(n.pos[0] + n.size[0] * 0.35, n.pos[1] + w.y + (w.computeSize?.(n.size[0])?.[1] ?? 20) / 2)};
}"""

JS_NODE_LABELS = """() => { const n = app.graph._nodes[0]; return {
    title: n.title,
    widgets: Object.fromEntries(n.widgets.map(w => [w.name, w.label ?? w.name])),
    inputs: Object.fromEntries(n.inputs.map(i => [i.name, i.localized_name ?? i.label ?? i.name])),
    outputs: n.outputs.map(o => o.localized_name ?? o.label ?? o.name)}; }"""

# what web/js/keep_translations.js leaves when it restored the pack's translations of a language (else absent)
JS_RESTORED = "() => document.documentElement.dataset.tiledAttentionRestoredLocales ?? null"
SCRIPT = "tiled-attention.keep-translations"  # its extension name, for the frontend's Comfy.Extension.Disabled

# a second pack with its own translation: one node, locales/<lang>/nodeDefs.json, as ComfyUI loads any pack
OTHER_NODE = "OtherPackCounter"
OTHER_PACK = {
    "__init__.py": (
        "class OtherPackCounter:\n"
        "    CATEGORY = 'other_pack'\n"
        "    RETURN_TYPES = ('INT',)\n"
        "    FUNCTION = 'run'\n\n"
        "    @classmethod\n"
        "    def INPUT_TYPES(cls):\n"
        "        return {'required': {'count': ('INT', {'default': 1, 'tooltip': 'How many.'})}}\n\n"
        "    def run(self, count):\n"
        "        return (count,)\n\n\n"
        f"NODE_CLASS_MAPPINGS = {{'{OTHER_NODE}': OtherPackCounter}}\n"
        f"NODE_DISPLAY_NAME_MAPPINGS = {{'{OTHER_NODE}': 'Other Pack Counter'}}\n"),
    "locales/ja/nodeDefs.json": {OTHER_NODE: {"display_name": "別パックのカウンター",
                                              "inputs": {"count": {"name": "個数", "tooltip": "いくつ。"}}}},
    "locales/ru/nodeDefs.json": {OTHER_NODE: {"display_name": "Счётчик другого пакета",
                                              "inputs": {"count": {"name": "количество", "tooltip": "Сколько."}}}},
}

# a node's title as the frontend registered it, and the labels of a new one
JS_REGISTERED = """(type) => {
    const n = LiteGraph.createNode(type);
    return {title: LiteGraph.registered_node_types[type].title,
            widgets: Object.fromEntries(n.widgets.map(w => [w.name, w.label ?? w.name]))};
}"""

JS_HELP_TEXT = """() => [...document.querySelectorAll('.node-help-content')]
    .filter(e => e.getClientRects().length).map(e => e.innerText).join('\\n')"""


def _page_text(lang=None):
    path = os.path.join(ROOT, "web", "docs", f"{NODE}.md" if lang is None else os.path.join(NODE, f"{lang}.md"))
    with open(path, encoding="utf-8") as f:
        return f.read()


def _plain(markdown_line):
    """A markdown line as the rendered page shows it: no emphasis or code marks, single spaces."""
    return re.sub(r"\s+", " ", re.sub(r"[*`]", "", markdown_line)).strip()


def _page_marks(lang=None):
    """What only the help page (not the node's description) shows: its title, the start of its first paragraph,
    and each input's list item (the name and the start of what follows it)."""
    text = _page_text(lang)
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    title = paragraphs[0].lstrip("# ").strip()
    first = _plain(" ".join(paragraphs[1].split()))[:40]
    items = [_plain(line[2:])[:30] for line in text.splitlines() if line.startswith("- **`")]
    return title, first, items


def _write_other_pack(custom_nodes):
    for rel, content in OTHER_PACK.items():
        path = os.path.join(custom_nodes, "other_translated_pack", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content if isinstance(content, str) else json.dumps(content, ensure_ascii=False))


@pytest.fixture(scope="module", params=[OLDEST, LATEST], ids=[f"comfyui-{v}" for v in (OLDEST, LATEST)])
def server(request, tmp_path_factory):
    version = request.param
    srv = start_server(version, tmp_path_factory.mktemp(f"comfy-help-{version}"),
                       prepare=lambda srv: _write_other_pack(os.path.join(srv.base, "custom_nodes")))
    srv.artifacts = os.path.join(ARTIFACTS, f"comfyui-{version}")
    os.makedirs(srv.artifacts, exist_ok=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(server):
    """A Chromium page; open(locale, **settings) saves the settings, (re)loads the app and waits until it is up."""
    with chromium(VIEWPORT, INIT_SCRIPT + ";\n" + START_EMPTY, os.path.join(server.artifacts, "console.log")) \
            as (_ctx, pg):
        def open_app(locale, **more_settings):
            for key, value in {"Comfy.Locale": locale, **more_settings}.items():
                assert post_json(f"{server.url}/settings/{key}", value) == 200
            load_app(pg, server.url, os.path.join(server.artifacts, f"startup-failure-{locale}.png"))
            got = pg.evaluate("() => app.extensionManager.setting.get('Comfy.Locale')")
            assert got == locale, f"the frontend runs in {got!r}, not {locale!r}"
            return pg

        pg.open_app = open_app
        yield pg


# ---- helpers ------------------------------------------------------------------------------------------------

def _one_node(pg):
    pg.evaluate(JS_ONE_NODE, NODE)
    pg.wait_for_timeout(300)
    return _points(pg)


def _points(pg):
    return pg.evaluate(JS_POINTS, TOOLTIP_WIDGET)


def _hover_widget(pg):
    """Move the mouse onto the tooltip widget (from just beside it, so the canvas sees a move) and wait for the
    frontend's tooltip."""
    x, y = _points(pg)["widget"]
    pg.mouse.move(x - 8, y - 4)
    pg.wait_for_timeout(150)
    pg.mouse.move(x, y)
    tooltip = pg.locator(".node-tooltip")
    tooltip.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    return tooltip.inner_text().strip()


def _select_and_open_info(pg, points):
    """A real click on the node's title, then the selection toolbox's info button."""
    pg.mouse.click(*points["title"])
    button = pg.locator('[data-testid="info-button"]')
    button.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    button.click()


def _wait_help(pg, lang=None, what=""):
    """Until the visible help panel shows the help page (not the description fallback); returns its text."""
    title, first, items = _page_marks(lang)
    deadline = time.time() + UI_TIMEOUT_MS / 1000
    text = ""
    while time.time() < deadline:
        text = re.sub(r"\s+", " ", pg.evaluate(JS_HELP_TEXT))
        if title in text and first in text and all(i in text for i in items):
            return text
        pg.wait_for_timeout(250)
    raise AssertionError(f"{what}: the help panel does not show web/docs/{NODE}{'/' + lang if lang else ''}.md "
                         f"(want {title!r}, {first!r}, {items}); it shows: {text[:1500]!r}\nconsole:\n"
                         + "\n".join(pg.console[-20:]))


def _shot(pg, server, name):
    path = os.path.join(server.artifacts, f"{name}.png")
    pg.wait_for_timeout(300)
    pg.screenshot(path=path)
    assert os.path.getsize(path) > 10_000
    return path


def _library_search(pg, text):
    pg.locator(".node-library-tab-button").click(timeout=UI_TIMEOUT_MS)
    box = pg.locator(".side-bar-panel input").first
    box.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    box.fill(text)


# ---- tests --------------------------------------------------------------------------------------------------

def test_help_page_opens_from_the_nodes_info_button(server, browser):
    pg = browser.open_app("en")
    points = _one_node(pg)
    # in English the pack's keep_translations.js has nothing to restore, on either frontend
    assert pg.evaluate(JS_NODE_LABELS)["title"] == DISPLAY and pg.evaluate(JS_RESTORED) is None
    _select_and_open_info(pg, points)
    text = _wait_help(pg, None, f"ComfyUI {server.version}, the node's info button")
    assert "Which mode" in text and "Errors" in text
    _shot(pg, server, "help-info-button-en")


def test_help_page_opens_from_the_node_library(server, browser):
    pg = browser.open_app("en", **{"Comfy.NodeLibrary.NewDesign": True})
    _library_search(pg, DISPLAY)
    if server.version == LATEST:  # 1.49.6's default library: rows carry a bookmark button only
        row = pg.locator('.side-bar-panel [role="treeitem"]', has_text=DISPLAY).first
        row.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
        row.hover()
        pg.wait_for_timeout(500)
        buttons = row.locator("button").evaluate_all("bs => bs.map(b => b.getAttribute('aria-label'))")
        assert buttons == ["Bookmark"], f"1.49.6's node library row now has buttons {buttons}: test its help button"
        pg = browser.open_app("en", **{"Comfy.NodeLibrary.NewDesign": False})  # the classic library
        _library_search(pg, DISPLAY)
    row = pg.locator(".side-bar-panel .p-tree-node-content", has_text=DISPLAY).first
    row.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    row.hover()
    row.locator(".help-button").click(timeout=UI_TIMEOUT_MS)
    _wait_help(pg, None, f"ComfyUI {server.version}, the node library's help button")
    _shot(pg, server, "help-node-library-en")
    post_json(f"{server.url}/settings/Comfy.NodeLibrary.NewDesign", True)  # back to the default for later loads


def _translated(pg, key):
    return pg.evaluate(f"(k) => {JS_STORES}.$t(k)", key) != key


def _other_pack_as_the_frontend_shows_it(server, lang):
    """The other pack's node in that language, as each frontend shows it by itself: 1.32.9 drops its translation
    (the frontend's bug, which this pack's script leaves alone), 1.49.6 keeps it."""
    entry = OTHER_PACK[f"locales/{lang}/nodeDefs.json"][OTHER_NODE]
    if server.version == OLDEST:
        return {"title": "Other Pack Counter", "widgets": {"count": "count"}}
    return {"title": entry["display_name"], "widgets": {"count": entry["inputs"]["count"]["name"]}}


def _check_script_acted_only_where_needed(pg, server, langs):
    restored = pg.evaluate(JS_RESTORED)
    if server.version == OLDEST:  # 1.32.9 dropped the translations: the script restored them
        assert restored == " ".join(langs), f"keep_translations.js restored {restored!r}, not {langs}"
    else:  # 1.49.6 keeps them: the script must leave it alone
        assert restored is None, f"keep_translations.js acted on frontend {server.frontend}: {restored!r}"


@pytest.mark.parametrize("lang", LANGS)
def test_nodes_show_their_translated_names_and_tooltips(server, browser, lang):
    node_defs = load_json(os.path.join(ROOT, "locales", lang, "nodeDefs.json"))[NODE]
    served = server.get("/i18n")[lang]["nodeDefs"][NODE]
    assert served == node_defs, f"the server's /i18n does not carry locales/{lang}/nodeDefs.json"
    pg = browser.open_app(lang)
    assert _translated(pg, "nodeDefs.KSampler.display_name"), f"the frontend has no {lang} messages of its own"
    _one_node(pg)
    labels = pg.evaluate(JS_NODE_LABELS)
    want_inputs = {name: entry["name"] for name, entry in node_defs["inputs"].items()}
    assert labels["title"] == node_defs["display_name"], labels
    assert labels["widgets"] == {k: v for k, v in want_inputs.items() if k != "model"}, labels
    assert labels["inputs"]["model"] == want_inputs["model"], labels
    assert _hover_widget(pg) == node_defs["inputs"][TOOLTIP_WIDGET]["tooltip"]
    _shot(pg, server, f"node-{lang}")
    # and the node library: the category and the node under their translated names
    _library_search(pg, node_defs["display_name"])
    row = pg.locator(".side-bar-panel [role='treeitem']", has_text=node_defs["display_name"]).first
    row.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    category = load_json(os.path.join(ROOT, "locales", lang, "main.json"))["nodeCategories"]["attention"]
    assert pg.locator(".side-bar-panel [role='treeitem']", has_text=category).count() >= 1
    _hover_widget(pg)
    _shot(pg, server, f"node-{lang}-library")
    # web/js/keep_translations.js acted on 1.32.9 alone, and on this pack's nodes alone
    _check_script_acted_only_where_needed(pg, server, [lang])
    assert pg.evaluate(JS_REGISTERED, OTHER_NODE) == _other_pack_as_the_frontend_shows_it(server, lang)


@pytest.mark.parametrize("lang", LANGS)
def test_without_the_script_only_the_fixed_frontend_translates(server, browser, lang):
    """The pack's script disabled through the frontend's own setting: 1.32.9 shows the node in English although
    /i18n serves its translation and the frontend has its own messages of that language (the bug the script works
    around); 1.49.6 shows it translated (the script is not needed there)."""
    node_defs = load_json(os.path.join(ROOT, "locales", lang, "nodeDefs.json"))[NODE]
    try:
        pg = browser.open_app(lang, **{"Comfy.Extension.Disabled": [SCRIPT]})
        assert _translated(pg, "nodeDefs.KSampler.display_name"), f"the frontend has no {lang} messages of its own"
        assert pg.evaluate(JS_RESTORED) is None
        got = pg.evaluate(JS_REGISTERED, NODE)
        if server.version == OLDEST:
            assert got["title"] == DISPLAY and got["widgets"][TOOLTIP_WIDGET] == TOOLTIP_WIDGET, got
            assert not _translated(pg, f"nodeDefs.{NODE}.display_name")
        else:
            assert got["title"] == node_defs["display_name"], got
            assert got["widgets"][TOOLTIP_WIDGET] == node_defs["inputs"][TOOLTIP_WIDGET]["name"], got
    finally:
        assert post_json(f"{server.url}/settings/Comfy.Extension.Disabled", []) == 200


def test_translations_follow_a_language_switch(server, browser):
    """ja at start, then ru chosen in the running app (the frontend's settings API, as its settings dialog): a new
    node's widget labels and its tooltip come out in Russian. Its title is not checked: both frontends refresh the node
    definitions as the switch starts, and when that ends before the new language has loaded, every node (the core
    ones too) keeps the previous language's name until the next refresh or reload."""
    node_defs = load_json(os.path.join(ROOT, "locales", "ru", "nodeDefs.json"))[NODE]
    pg = browser.open_app("ja")
    pg.evaluate("() => app.extensionManager.setting.set('Comfy.Locale', 'ru')")
    pg.wait_for_function(f"() => {JS_STORES}.$i18n.locale === 'ru'", timeout=UI_TIMEOUT_MS, polling=100)
    want = {k: v["name"] for k, v in node_defs["inputs"].items() if k != "model"}
    try:
        pg.wait_for_function(f"(want) => ({JS_REGISTERED})('{NODE}').widgets.{TOOLTIP_WIDGET} === want",
                             arg=want[TOOLTIP_WIDGET], timeout=UI_TIMEOUT_MS, polling=200)
    except Exception as e:  # noqa: BLE001 - report what it shows instead
        raise AssertionError(f"after switching to ru, a new node shows {pg.evaluate(JS_REGISTERED, NODE)}") from e
    _one_node(pg)
    assert pg.evaluate(JS_NODE_LABELS)["widgets"] == want
    assert _hover_widget(pg) == node_defs["inputs"][TOOLTIP_WIDGET]["tooltip"]
    _shot(pg, server, "node-ja-then-ru")
    _check_script_acted_only_where_needed(pg, server, ["ja", "ru"])


def test_translations_when_the_language_loads_late(server, browser):
    """ja chosen, but the frontend's own ja messages arrive only after it has registered the nodes (the browser holds
    the ja nodeDefs chunk until then, as a slow connection to a remote ComfyUI would): once they arrive, a new node's
    widget labels and its tooltip are in Japanese. (Its title was registered before, in English, as every core
    node's; it is not checked.)"""
    node_defs = load_json(os.path.join(ROOT, "locales", "ja", "nodeDefs.json"))[NODE]
    held = []

    def hold_ja_chunk(route):
        response = route.fetch()
        if "サンプラー" in response.text():  # the frontend's ja nodeDefs (KSampler: Kサンプラー)
            held.append((route, response))
        else:
            route.fulfill(response=response)

    pattern = "**/assets/nodeDefs-*.js"
    browser.route(pattern, hold_ja_chunk)
    try:
        pg = browser.open_app("ja")
        assert held, "the frontend asked for no ja nodeDefs chunk: the test no longer holds back its ja messages"
        early = pg.evaluate(JS_REGISTERED, "KSampler")["title"]
        assert early == "KSampler", f"the nodes were registered after the ja messages arrived ({early!r})"
        for route, response in held:
            route.fulfill(response=response)
        held.clear()
        pg.wait_for_function(f"() => {JS_STORES}.$i18n.locale === 'ja'", timeout=UI_TIMEOUT_MS, polling=100)
        want = {k: v["name"] for k, v in node_defs["inputs"].items() if k != "model"}
        try:
            pg.wait_for_function(f"(want) => ({JS_REGISTERED})('{NODE}').widgets.{TOOLTIP_WIDGET} === want",
                                 arg=want[TOOLTIP_WIDGET], timeout=UI_TIMEOUT_MS, polling=200)
        except Exception as e:  # noqa: BLE001 - report what it shows instead
            raise AssertionError(f"once the ja messages arrived, a new node shows {pg.evaluate(JS_REGISTERED, NODE)}") \
                from e
        _one_node(pg)
        assert pg.evaluate(JS_NODE_LABELS)["widgets"] == want
        assert _hover_widget(pg) == node_defs["inputs"][TOOLTIP_WIDGET]["tooltip"]
        _shot(pg, server, "node-ja-loaded-late")
        _check_script_acted_only_where_needed(pg, server, ["ja"])
    finally:
        browser.unroute(pattern, hold_ja_chunk)
        for route, response in held:
            route.fulfill(response=response)


@pytest.mark.parametrize("lang", LANGS)
def test_help_page_follows_the_language(server, browser, lang):
    pg = browser.open_app(lang)
    _select_and_open_info(pg, _one_node(pg))
    _wait_help(pg, lang, f"ComfyUI {server.version}, the node's info button in {lang}")
    _shot(pg, server, f"help-info-button-{lang}")
