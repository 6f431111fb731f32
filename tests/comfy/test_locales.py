"""The pack's node help pages and its translations (ja, ru, zh), against the live node schemas of both ComfyUIs.

What the frontend reads, and where (checked in the bundles of frontends 1.32.9 and 1.49.6 and in ComfyUI's
server.py / nodes.py / app/custom_node_manager.py of 0.3.75 and 0.33.0):
- help pages: for a node whose `python_module` is `custom_nodes.<folder>`, GET
  /extensions/<folder>/docs/<node id>/<locale>.md, else /extensions/<folder>/docs/<node id>.md. ComfyUI serves
  /extensions/<folder>/ from the folder the pack's WEB_DIRECTORY names (`web/`), keyed by the custom_nodes folder
  name, which is what the frontend takes from python_module;
- translations: GET /i18n merges every pack's locales/<lang>/main.json and nodeDefs.json; the frontend looks up
  nodeDefs.<node id>.display_name / .description / .inputs.<input>.name / .inputs.<input>.tooltip /
  .outputs.<index>.tooltip, and .outputs.<index>.name where the output's name differs from its type (else
  dataTypes.<type>); category segments under nodeCategories.<segment>. Neither frontend translates a combo's option
  values (they are what the prompt sends), so options stay as they are; where a tooltip names them they must stay
  verbatim in its translation.

Drift is a failure: a node, input, output or tooltip in a live /object_info (either ComfyUI) without its
translation in every language, a translation of something no schema has, a help page missing for a node or
language, a page that does not name every input, output and option of its node. Staleness is a failure too:
locales/translated_from.json records, per language, the English each translation was made from (the text of each
string, the SHA-256 of each English help page); when the English changes, the test names every translation made
from the old text. After translating the new English, record it with

    python tests/comfy/test_locales.py --mark-current LANG KEY [KEY ...]

(KEY as the failure names it, e.g. nodeDefs.TiledAttentionPatch.inputs.mode.tooltip or docs/TiledAttentionPatch.md;
it asks ComfyUI 0.33.0 in a subprocess for the current English). The help pages' error sections quote the messages
the code raises: each quote must be text of a string literal in nodes/ or attention_core/.
"""
import ast
import glob
import hashlib
import json
import os
import re
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request

import pytest

if __name__ == "__main__":  # the maintainer's command below: the repository root and tests/support importable
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:0] = [_root, os.path.join(_root, "tests", "support")]

from tools.comfyui_setup.comfyui import LATEST, OLDEST, ROOT, comfy_path  # noqa: E402

LANGS = ("ja", "ru", "zh")
LOCALES = os.path.join(ROOT, "locales")
DOCS = os.path.join(ROOT, "web", "docs")
RECORD = os.path.join(LOCALES, "translated_from.json")
PACK_FOLDER = "tiled-attention"  # the custom_nodes folder ComfyServer links this checkout as
# technical names that are the same word in every language (input names the core frontend keeps too)
SAME_IN_EVERY_LANGUAGE = {"clip", "vae", "dtype"}
UNITS = {"ru": {"MB": "МБ", "GB": "ГБ"}}  # Russian technical writing abbreviates units in Cyrillic
SCRIPTS = {"ja": re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]"),  # kana, kanji
           "ru": re.compile(r"[\u0400-\u04ff]"),
           "zh": re.compile(r"[\u4e00-\u9fff]")}
KANA = re.compile(r"[\u3040-\u30ff]")


# ---- the English the schemas carry ------------------------------------------------------------------------

def pack_nodes(object_info):
    return {k: v for k, v in object_info.items() if v.get("python_module") == f"custom_nodes.{PACK_FOLDER}"}


def visible_inputs(node):
    """(name, options) of the inputs the frontend shows (required and optional, not hidden), in order."""
    for group in ("required", "optional"):
        for name, spec in node["input"].get(group, {}).items():
            yield name, (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})


def options_of(spec_options, node, name):
    for group in ("required", "optional"):
        spec = node["input"].get(group, {}).get(name)
        if spec:
            if isinstance(spec[0], list):
                return list(spec[0])
            return list(spec_options.get("options", []))
    return []


def english_strings(object_info):
    """{i18n key: English} of every string the frontend translates, for this pack's nodes."""
    out = {}
    for node_id, node in sorted(pack_nodes(object_info).items()):
        key = f"nodeDefs.{node_id}"
        out[f"{key}.display_name"] = node["display_name"]
        if node.get("description"):
            out[f"{key}.description"] = node["description"]
        for name, opts in visible_inputs(node):
            out[f"{key}.inputs.{name}.name"] = opts.get("display_name") or name
            if opts.get("tooltip"):
                out[f"{key}.inputs.{name}.tooltip"] = opts["tooltip"]
        tooltips = node.get("output_tooltips") or []
        for i, (kind, name) in enumerate(zip(node["output"], node["output_name"])):
            if name != kind:  # else the frontend shows dataTypes.<type>, translated by the frontend itself
                out[f"{key}.outputs.{i}.name"] = name
            if i < len(tooltips) and tooltips[i]:
                out[f"{key}.outputs.{i}.tooltip"] = tooltips[i]
    for node in pack_nodes(object_info).values():
        for segment in node["category"].split("/"):
            if segment != "model_patches":  # a core category: the frontend's own locales translate it (or not)
                out[f"main.nodeCategories.{segment}"] = segment
    return out


# ---- what the pack ships ----------------------------------------------------------------------------------

def flatten(tree, prefix):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}.{k}"))
        else:
            out[f"{prefix}.{k}"] = v
    return out


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def locale_strings(lang):
    """{i18n key: translation} from locales/<lang>/nodeDefs.json and main.json."""
    out = flatten(load_json(os.path.join(LOCALES, lang, "nodeDefs.json")), "nodeDefs")
    out.update(flatten(load_json(os.path.join(LOCALES, lang, "main.json")), "main"))
    return out


def page_path(node_id, lang=None):
    return os.path.join(DOCS, f"{node_id}.md") if lang is None else os.path.join(DOCS, node_id, f"{lang}.md")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def page_key(node_id):
    return f"docs/{node_id}.md"


def code_spans(text):
    """Inline code spans of a markdown text (fenced blocks excluded), in order."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def sections(text):
    """[(heading, body)] of the '## ' sections of a page."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def error_quotes(text):
    """The messages the last section (the errors) quotes: the first code span of each of its bullets."""
    body = sections(text)[-1][1]
    return [spans[0] for line in body.splitlines() if line.startswith("- ") and (spans := code_spans(line))]


def technical_tokens(english, options=()):
    """Words of an English string that every translation keeps verbatim: identifiers and model names (a digit,
    an underscore or an inner colon, e.g. gfx906, bf16_to_fp16, cuda:0, LTX-2.3), acronyms (SDPA, VAE),
    CamelCase names (ComfyUI, WanVideoWrapper), and the option values the string names."""
    tokens = set()
    for word in re.findall(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*", english):
        word = word.rstrip(".:-")
        if not word or word[0].isdigit() or not re.search(r"[A-Za-z]", word):
            continue
        if (re.search(r"[0-9_]", word) or re.search(r"\w:\w", word) or re.fullmatch(r"[A-Z][A-Z0-9]+", word)
                or re.search(r"[a-z][A-Z]", word)):
            tokens.add(word)
    for option in options:
        if re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", english):
            tokens.add(option)
    return tokens


# ---- the error messages the code can raise ----------------------------------------------------------------

def _module_constants(tree):
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    consts[target.id] = node.value.value
    return consts


def message_templates():
    """Every string literal of nodes/ and attention_core/, f-strings with their replacement fields as NUL
    (a field that names a module-level string constant, e.g. {ENV}, as that constant's text)."""
    templates = []
    for path in glob.glob(os.path.join(ROOT, "nodes", "*.py")) + glob.glob(
            os.path.join(ROOT, "attention_core", "**", "*.py"), recursive=True):
        tree = ast.parse(read(path))
        consts = _module_constants(tree)
        in_fstring = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts = []
                for value in node.values:
                    in_fstring.add(id(value))
                    if isinstance(value, ast.Constant):
                        parts.append(str(value.value))
                    elif isinstance(value.value, ast.Name) and value.value.id in consts and not value.format_spec:
                        parts.append(consts[value.value.id])
                    else:
                        parts.append("\0")
                templates.append("".join(parts))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
                templates.append(node.value)
    return templates


def unmatched_quote_parts(quote, templates, display_names):
    """The parts of an error quote ('…' marks what varies) that no string literal of the code contains. A leading
    '<node display name>: ' is the node's name that the code inserts and is not looked up."""
    for name in display_names:
        if quote.startswith(name + ": "):
            quote = quote[len(name) + 2:]
            break
    parts = [p.strip() for p in quote.split("…")]
    return [p for p in parts if p and not any(p in t for t in templates)]


# ---- servers: /object_info, /i18n and the help pages as each ComfyUI serves them ------------------------------

def _get(url, as_json=True):
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
    return json.loads(body) if as_json else body.decode("utf-8")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """For ComfyUI 0.3.75 and 0.33.0 (one server each, one after the other, this pack alone in custom_nodes): its
    /object_info, /i18n, and every help page of the pack's nodes fetched at the URLs the frontend builds."""
    from comfy_harness import missing
    from tools.comfyui_setup.comfy_server import ComfyServer
    out = {}
    for version in (OLDEST, LATEST):
        if comfy_path(version) is None:
            missing(f"no ComfyUI {version}: run the suite with ./dev test (it sets up the stock ComfyUIs)")
        with ComfyServer(tmp_path_factory.mktemp(f"locales-{version}"), version=version,
                         extra_custom_nodes=()) as server:
            info = server.get("/object_info")
            pages = {}
            for node_id, node in pack_nodes(info).items():
                base = help_base_url(node)
                for lang in (None, *LANGS):
                    url = server.url + base + (f"{node_id}.md" if lang is None else f"{node_id}/{lang}.md")
                    try:
                        pages[(node_id, lang)] = _get(url, as_json=False)
                    except urllib.error.HTTPError as e:
                        pages[(node_id, lang)] = e
            out[version] = {"object_info": info, "i18n": server.get("/i18n"), "pages": pages, "log": server.log()}
        assert pack_nodes(out[version]["object_info"]), f"ComfyUI {version} has none of the pack's nodes:\n" \
                                                       + out[version]["log"][-3000:]
    return out


def help_base_url(node):
    """The folder URL the frontend (1.32.9 and 1.49.6: getNodeHelpBaseUrl) fetches a custom node's help from."""
    parts = (node.get("python_module") or "").split(".")
    assert len(parts) >= 2 and parts[0] == "custom_nodes", node.get("python_module")
    return f"/extensions/{urllib.parse.quote(parts[1].split('@')[0])}/docs/"


@pytest.fixture(scope="module")
def english(served):
    """{version: {key: English}} and the union over both versions."""
    per_version = {v: english_strings(s["object_info"]) for v, s in served.items()}
    union = {}
    for strings in per_version.values():
        for k, v in strings.items():
            assert union.setdefault(k, v) == v, f"{k} reads differently in the two ComfyUIs"
    return per_version, union


@pytest.fixture(scope="module")
def record():
    return load_json(RECORD)


VERSIONS = pytest.mark.parametrize("version", [OLDEST, LATEST], ids=[f"comfyui-{v}" for v in (OLDEST, LATEST)])
PER_LANG = pytest.mark.parametrize("lang", LANGS)


# ---- tests ----------------------------------------------------------------------------------------------------

@VERSIONS
def test_comfyui_serves_the_translations_and_help_pages(served, version):
    s = served[version]
    assert sorted(s["i18n"]) == sorted(LANGS), f"/i18n of ComfyUI {version} serves languages {sorted(s['i18n'])}"
    for lang in LANGS:
        got = s["i18n"].get(lang, {})
        assert got.get("nodeDefs") == load_json(os.path.join(LOCALES, lang, "nodeDefs.json")), \
            f"/i18n of ComfyUI {version} does not carry locales/{lang}/nodeDefs.json as it is"
        for k, v in load_json(os.path.join(LOCALES, lang, "main.json")).get("nodeCategories", {}).items():
            assert got.get("nodeCategories", {}).get(k) == v, (lang, k)
    for (node_id, lang), page in s["pages"].items():
        assert not isinstance(page, Exception), \
            f"ComfyUI {version} does not serve the help page of {node_id} ({lang or 'en'}): {page}"
        assert page == read(page_path(node_id, lang)), (node_id, lang)


@VERSIONS
@PER_LANG
def test_every_schema_string_is_translated(english, version, lang):
    wanted = english[0][version]
    have = locale_strings(lang)
    missing_keys = sorted(set(wanted) - set(have))
    assert not missing_keys, (f"locales/{lang} lacks the translation of what ComfyUI {version} shows:\n"
                              + "\n".join(f"  {k}: {wanted[k]!r}" for k in missing_keys))
    empty = sorted(k for k in wanted if not str(have[k]).strip())
    assert not empty, f"locales/{lang}: empty translations {empty}"


@PER_LANG
def test_no_translation_of_what_no_schema_has(english, lang):
    extra = sorted(set(locale_strings(lang)) - set(english[1]))
    assert not extra, f"locales/{lang} translates what neither ComfyUI's schema has (renamed or removed?): {extra}"


@PER_LANG
def test_translations_were_made_from_the_current_english(english, record, lang):
    made_from = record.get(lang, {})
    stale = []
    for key, text in sorted(english[1].items()):
        if key not in locale_strings(lang):
            continue  # reported by test_every_schema_string_is_translated
        if made_from.get(key) != text:
            stale.append(f"  {key}\n    translated from: {made_from.get(key)!r}\n    English now:     {text!r}")
    assert not stale, (f"stale {lang} translations (update the translation, then "
                       f"`python tests/comfy/test_locales.py --mark-current {lang} KEY...`):\n" + "\n".join(stale))
    unknown = sorted(k for k in made_from if not k.startswith("docs/") and k not in english[1])
    assert not unknown, f"locales/translated_from.json[{lang}] records keys no schema has: {unknown}"


@PER_LANG
def test_translations_keep_technical_names(served, english, lang):
    have = locale_strings(lang)
    info = served[LATEST]["object_info"]
    lost = []
    for key, text in english[1].items():
        if key not in have or key.endswith(".name"):  # names are labels: the frontend shows them translated
            continue
        node = info.get(key.split(".")[1], {}) if key.startswith("nodeDefs.") else {}
        options = []
        if ".inputs." in key and node:
            name = key.split(".")[3]
            opts = dict(visible_inputs(node)).get(name, {})
            options = options_of(opts, node, name)
        for token in technical_tokens(text, options):
            alternatives = {token, UNITS.get(lang, {}).get(token, token)}
            if re.fullmatch(r"\w*[A-Z]s", token):  # an acronym's English plural (GPUs, DiTs): other languages
                alternatives.add(token[:-1])  # have none
            if not any(re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])", have[key]) for a in alternatives):
                lost.append(f"  {key}: {token!r} not in {have[key]!r}")
    assert not lost, f"{lang} translations lost technical names:\n" + "\n".join(lost)


@PER_LANG
def test_translations_are_written_in_their_language(english, lang):
    have = locale_strings(lang)
    wrong = []
    for key, text in english[1].items():
        if key not in have:
            continue
        if have[key] == text and text not in SAME_IN_EVERY_LANGUAGE:
            wrong.append(f"  {key}: left in English ({text!r})")
        elif have[key] != text and not SCRIPTS[lang].search(have[key]):
            wrong.append(f"  {key}: no {lang} script in {have[key]!r}")
        elif lang == "zh" and KANA.search(have[key]):
            wrong.append(f"  {key}: Japanese kana in the Chinese text {have[key]!r}")
    assert not wrong, "\n".join(wrong)


@VERSIONS
def test_every_node_has_help_pages_naming_its_inputs_outputs_and_options(served, version):
    problems = []
    for node_id, node in sorted(pack_nodes(served[version]["object_info"]).items()):
        names = [name for name, _ in visible_inputs(node)]
        names += [n for n in node["output_name"]]
        for name, opts in visible_inputs(node):
            names += options_of(opts, node, name)
        for lang in (None, *LANGS):
            path = page_path(node_id, lang)
            if not os.path.isfile(path):
                problems.append(f"  no help page {os.path.relpath(path, ROOT)}")
                continue
            spans = set(code_spans(read(path)))
            absent = [n for n in names if n not in spans]
            if absent:
                problems.append(f"  {os.path.relpath(path, ROOT)} never names (as `code`): {absent}")
    assert not problems, f"help pages against ComfyUI {version}'s schema:\n" + "\n".join(problems)


@PER_LANG
def test_help_pages_were_translated_from_the_current_english(served, record, lang):
    stale = []
    for node_id in sorted(pack_nodes(served[LATEST]["object_info"])):
        now = sha256(page_path(node_id))
        made_from = record.get(lang, {}).get(page_key(node_id))
        if made_from != now:
            stale.append(f"  web/docs/{node_id}/{lang}.md: translated from English sha256 {made_from}, "
                         f"web/docs/{node_id}.md is now {now} (git log -p web/docs/{node_id}.md shows what changed)")
    assert not stale, (f"stale {lang} help pages (update them, then `python tests/comfy/test_locales.py "
                       f"--mark-current {lang} docs/<node id>.md`):\n" + "\n".join(stale))


def test_help_pages_quote_errors_the_code_raises(served):
    templates = message_templates()
    nodes = pack_nodes(served[LATEST]["object_info"])
    display_names = sorted({n["display_name"] for n in nodes.values()}, key=len, reverse=True)
    problems = []
    for node_id in sorted(nodes):
        english_page = read(page_path(node_id))
        quotes = error_quotes(english_page)
        for quote in quotes:
            parts = unmatched_quote_parts(quote, templates, display_names)
            if parts:
                problems.append(f"  web/docs/{node_id}.md quotes `{quote}`: no message of the code contains {parts}")
        for lang in LANGS:
            translated = error_quotes(read(page_path(node_id, lang)))
            if translated != quotes:
                problems.append(f"  web/docs/{node_id}/{lang}.md quotes {translated}, the English page {quotes}")
    assert not problems, "\n".join(problems)


@PER_LANG
def test_translated_pages_keep_the_structure_and_every_technical_name(served, lang):
    problems = []
    names = locale_strings(lang)
    for node_id, node in sorted(pack_nodes(served[LATEST]["object_info"]).items()):
        english_page, page = read(page_path(node_id)), read(page_path(node_id, lang))
        title = names.get(f"nodeDefs.{node_id}.display_name")
        if not page.startswith(f"# {title}\n"):
            problems.append(f"  {node_id}/{lang}.md does not open with '# {title}' (the node's {lang} name)")
        if len(sections(page)) != len(sections(english_page)):
            problems.append(f"  {node_id}/{lang}.md has {len(sections(page))} sections, the English page "
                            f"{len(sections(english_page))}")
        lost = sorted(set(code_spans(english_page)) - set(code_spans(page)))
        if lost:
            problems.append(f"  {node_id}/{lang}.md lacks the English page's code spans {lost}")
        if not (KANA if lang == "ja" else SCRIPTS[lang]).search(page) or (lang == "zh" and KANA.search(page)):
            problems.append(f"  {node_id}/{lang}.md is not written in {lang}")
    assert not problems, "\n".join(problems)


def test_i18n_keys_are_the_frontends():
    """The frontend normalises a '.' in a node id or an input name to '_' in its keys; the files must use the same
    key (none of the pack's names has one today)."""
    for lang in LANGS:
        for node_id, entry in load_json(os.path.join(LOCALES, lang, "nodeDefs.json")).items():
            assert "." not in node_id, node_id
            for name in list(entry.get("inputs", {})) + list(entry.get("outputs", {})):
                assert "." not in name, (node_id, name)


# ---- recording what a translation was made from (a maintainer's command, never run by the tests) ---------------

def _current_english():
    from live_schema import pack_object_info
    strings = english_strings({k: dict(v, python_module=f"custom_nodes.{PACK_FOLDER}")
                               for k, v in pack_object_info(LATEST).items()})
    for path in glob.glob(os.path.join(DOCS, "*.md")):
        strings[page_key(os.path.basename(path)[:-3])] = sha256(path)
    return strings


def mark_current(lang, keys):
    """Record the current English of `keys` (i18n keys or docs/<node id>.md) as what lang's translations were made
    from."""
    if lang not in LANGS:
        raise SystemExit(f"error: unknown language {lang!r}; one of {', '.join(LANGS)}")
    english = _current_english()
    unknown = [k for k in keys if k not in english]
    if unknown:
        raise SystemExit(f"error: no such English string or page: {unknown}")
    rec = load_json(RECORD) if os.path.exists(RECORD) else {}
    rec.setdefault(lang, {}).update({k: english[k] for k in keys})
    rec[lang] = dict(sorted(rec[lang].items()))
    with open(RECORD, "w", encoding="utf-8") as f:
        json.dump(dict(sorted(rec.items())), f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{RECORD}: {lang} marked current for {len(keys)} key(s)")


if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] == "--mark-current":
    mark_current(sys.argv[2], sys.argv[3:])
