"""The glossary of the pack's translations (locales/{ja,ru,zh} and web/docs/<node>/<lang>.md): for each language, the
English terms that change what a user does, each with its one rendering and the renderings that are wrong for it.

Each rendering is ComfyUI's own where its frontend has the term: the frontend this test environment pins
(comfyui-frontend-package 1.49.6, the one ComfyUI 0.33.0 ships) carries its locale files in its source maps
(src/locales/<lang>/main.json), and `test_each_rendering_is_the_frontends_own` reads them there. Where the frontend
has no such term (route: sending a call to the engine), the rendering is this pack's, and is still the only one.

A "unit" is one translated string (its English is what locales/translated_from.json records; the staleness test in
test_locales.py keeps that equal to the schema's English) or one help page (its English is web/docs/<node>.md). In
every unit whose English has the term, the translation has its rendering; no unit has a wrong rendering, except as
often as its English has the word that rendering rightly translates (`unless`: a Russian «копия» is right where the
English says copy, e.g. the engine's copies of K and V, and wrong for a ComfyUI clone, which shares the weights).
The help pages also list each input (and each output the pack names) by its id and by the label the frontend
shows for it in that language.
"""
import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCALES = os.path.join(ROOT, "locales")
DOCS = os.path.join(ROOT, "web", "docs")
LANGS = ("ja", "ru", "zh")


@dataclass(frozen=True)
class Term:
    english: str                 # what the term is, for messages
    en: str                      # regex over the English of a unit: the unit uses the term
    rendering: str               # regex: the one rendering (in every unit whose English uses the term)
    wrong: Tuple[str, ...] = ()  # regexes: renderings that are wrong for it
    unless: Optional[str] = None  # regex over the English: a wrong match is allowed as often as this matches
    frontend: Optional[Tuple[str, str]] = None  # (key in the frontend's <lang>/main.json, the rendering there)
    pages_only: bool = field(default=False)


MEMORY = r"\bmemory\b(?!-efficient)"  # not the name of torch's memory-efficient backend
CLONE = r"\bclones?\b"
WORKFLOW = r"\bworkflows?\b"
PACK = r"\b(this|the|another|other|wrapper)\b[^.]{0,20}?\bpacks?\b|\bpacks with\b"
RUN = r"\blater prompts\b|\bevery prompt\b|\bafter the prompt\b"
ROUTE = r"\brout(e|es|ed|ing)\b"
OOM = "errorCatalog.runtimeErrors.out_of_memory.message"

GLOSSARY = {
    "zh": [
        Term("GPU memory", MEMORY, "显存", ("内存",), frontend=(OOM, "显存")),  # 内存 is system RAM in ComfyUI
        Term("clone", CLONE, "克隆", ("复制品",), unless=r"\bcop(y|ies)\b", frontend=("contextMenu.Clone", "克隆")),
        Term("workflow", WORKFLOW, "工作流", frontend=("g.workflow", "工作流")),
        Term("node pack", PACK, "节点包", ("插件",), frontend=("manager.nodePack", "节点包")),
        Term("prompt (one run)", RUN, "运行", ("之后的提示词", "每个提示词"), frontend=("menu.run", "运行")),
        Term("route (a call to the engine)", ROUTE, "接管"),
    ],
    "ja": [
        Term("GPU memory", MEMORY, "メモリ", frontend=(OOM, "メモリ")),
        Term("clone", CLONE, "クローン", ("複製",), frontend=("contextMenu.Clone", "クローン")),
        Term("workflow", WORKFLOW, "ワークフロー", frontend=("g.workflow", "ワークフロー")),
        Term("node pack", PACK, "ノードパック", (r"(?<!ノード)パック(?!ー)",), frontend=("manager.nodePack", "ノードパック")),
        Term("prompt (one run)", RUN, "実行", (r"(後|以降)のプロンプト", "プロンプトごと"), frontend=("menu.run", "実行")),
        # 切り替え is the mode switch (切り替えます); a routed call is 振り向けた, never 切り替えた
        Term("route (a call to the engine)", ROUTE, "振り向け", (r"切り替え(済み|られた|られる)", r"対象外")),
        Term("calque 「…で、これは…」", r"(?!)", "", (r"で、これは", r"。これは")),
    ],
    "ru": [
        Term("GPU memory", MEMORY, "памят", frontend=(OOM, "памяти")),
        # a ComfyUI clone shares the weights; «копия» reads as a second copy in VRAM
        Term("clone", CLONE, "клон", (r"(?<![а-яё])копи[а-яё]*",), unless=r"\bcop(y|ies|ied)\b",
             frontend=("contextMenu.Clone", "Клон")),
        Term("workflow", WORKFLOW, r"рабоч[а-яё]+ процесс", (r"граф",), unless=r"\bgraph\b",
             frontend=("g.workflow", "Рабочий процесс")),
        Term("route (a call to the engine)", ROUTE, "перенаправ"),
        Term("calque «против …» (versus)", r"(?!)", "", (r"(?<![а-яё])против(?![а-яё])",)),
    ],
}


# ---- the units ----------------------------------------------------------------------------------------------

def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def units(lang):
    """[(name, English, translation)] of lang's strings and help pages."""
    made_from = json.loads(_read(os.path.join(LOCALES, "translated_from.json")))[lang]
    out = []
    for part in ("main", "nodeDefs"):
        for key, text in _flat(json.loads(_read(os.path.join(LOCALES, lang, f"{part}.json")))):
            english = made_from.get(f"{part}.{key}")
            if isinstance(text, str) and english:
                out.append((f"locales/{lang}/{part}.json {key}", english, text))
    for path in sorted(glob.glob(os.path.join(DOCS, "*.md"))):
        node = os.path.basename(path)[:-3]
        out.append((f"web/docs/{node}/{lang}.md", _read(path), _read(os.path.join(DOCS, node, f"{lang}.md"))))
    return out


CODE = re.compile(r"`[^`\n]*`")  # code spans: ids, flags, the code's own messages, kept verbatim in every language


def _unit_problems(term, name, english, text):
    english, text = CODE.sub("", english), CODE.sub("", text)
    problems = []
    if re.search(term.en, english, re.I) and not re.search(term.rendering, text, re.I):
        problems.append(f"  {name}: the English says {term.english!r}, the translation lacks {term.rendering!r}")
    allowed = len(re.findall(term.unless, english, re.I)) if term.unless else 0
    for wrong in term.wrong:
        found = re.findall(wrong, text, re.I)
        if len(found) > allowed:
            where = [text[max(0, m.start() - 15): m.end() + 15].replace("\n", " ") for m in re.finditer(wrong, text, re.I)]
            problems.append(f"  {name}: {term.english!r} rendered wrongly as {wrong!r} ({len(found)} times, "
                            f"the English allows {allowed}): {where}")
    return problems


@pytest.mark.parametrize("lang", LANGS)
def test_each_term_has_its_one_rendering_and_never_a_wrong_one(lang):
    problems = []
    for term in GLOSSARY[lang]:
        for name, english, text in units(lang):
            problems += _unit_problems(term, name, english, text)
    assert not problems, f"{lang} glossary:\n" + "\n".join(problems)


def test_the_glossary_check_catches_what_the_issue_found():
    """The check itself, on the renderings issue 38 found: each is a problem, its fix is none."""
    zh = {t.english: t for t in GLOSSARY["zh"]}
    ru = {t.english: t for t in GLOSSARY["ru"]}
    ja = {t.english: t for t in GLOSSARY["ja"]}
    cases = [
        (zh["GPU memory"], "Memory the attention tiles may use", "注意力分块可使用的内存", "注意力分块可使用的显存"),
        (zh["node pack"], "remove this pack's patch", "移除本插件的补丁", "移除本节点包的补丁"),
        (zh["prompt (one run)"], "also for later prompts", "之后的提示词", "之后的运行"),
        (ru["clone"], "Patches a clone: the same model", "Патч ставится на копию модели", "Патч ставится на клон модели"),
        (ru["workflow"], "for workflows without this node", "для графов без этого узла",
         "для рабочих процессов без этого узла"),
        (ru["calque «против …» (versus)"], "against a reference", "против эталона", "сверкой с эталоном"),
        (ja["route (a call to the engine)"], "no call is routed twice", "二重に切り替えられる", "二重に振り向けられる"),
        (ja["prompt (one run)"], "for later prompts", "後のプロンプト", "以降の実行"),
    ]
    for term, english, bad, good in cases:
        assert _unit_problems(term, "x", english, bad), (term.english, bad)
        assert not _unit_problems(term, "x", english, good), (term.english, good)
    # copies the English itself names stay copies: the engine's copies of K and V
    assert not _unit_problems(ru["clone"], "x", "a clone, and the copies of K and V", "клон, и копии K и V")


# ---- ComfyUI's own renderings --------------------------------------------------------------------------------

def frontend_locale(lang):
    """The frontend's src/locales/<lang>/main.json, flattened, from the source maps of comfyui-frontend-package."""
    import comfyui_frontend_package
    assets = os.path.join(os.path.dirname(comfyui_frontend_package.__file__), "static", "assets")
    want = f"src/locales/{lang}/main.json"
    for path in sorted(glob.glob(os.path.join(assets, "main-*.js.map"))):
        data = json.loads(_read(path))
        for src, content in zip(data.get("sources", []), data.get("sourcesContent") or []):
            if src.endswith(want) and content:
                return dict(_flat(json.loads(content)))
    raise AssertionError(f"no {want} in the source maps of {assets}")


@pytest.mark.parametrize("lang", LANGS)
def test_each_rendering_is_the_frontends_own(lang):
    """Where ComfyUI's frontend translates the term, the glossary's rendering is the frontend's."""
    ui = frontend_locale(lang)
    problems = []
    for term in GLOSSARY[lang]:
        if term.frontend is None:
            continue
        key, shown = term.frontend
        if key not in ui or shown not in ui[key]:
            problems.append(f"  {term.english}: the frontend's {lang} {key} is {ui.get(key)!r}, not containing {shown!r}")
        elif not re.search(term.rendering, shown, re.I):
            problems.append(f"  {term.english}: the glossary's {term.rendering!r} is not the frontend's {shown!r}")
    assert not problems, "\n".join(problems)


# ---- help pages: id and label --------------------------------------------------------------------------------

LABEL = {"ja": "`{id}`「{label}」", "zh": "`{id}`“{label}”", "ru": "`{id}` «{label}»"}


@pytest.mark.parametrize("lang", LANGS)
def test_help_pages_list_inputs_and_outputs_by_id_and_translated_label(lang):
    """Each input's line on a translated help page opens with its id and the label the node shows in that
    language (locales/<lang>/nodeDefs.json's inputs.<id>.name), and so does each output the pack names."""
    defs = json.loads(_read(os.path.join(LOCALES, lang, "nodeDefs.json")))
    problems = []
    for node, entry in sorted(defs.items()):
        page = _read(os.path.join(DOCS, node, f"{lang}.md"))
        english = _read(os.path.join(DOCS, f"{node}.md"))
        outputs = re.findall(r"^- \*\*`(\w+)`", english.split("## ")[2], re.M) if english.count("## ") >= 2 else []
        labels = {i: v["name"] for i, v in entry.get("inputs", {}).items() if v.get("name")}
        labels.update({outputs[int(i)]: v["name"] for i, v in entry.get("outputs", {}).items()
                       if v.get("name") and int(i) < len(outputs)})
        for ident, label in labels.items():
            if label == ident:
                continue
            if not re.search(r"^- \*\*" + re.escape(LABEL[lang].format(id=ident, label=label)), page, re.M):
                problems.append(f"  web/docs/{node}/{lang}.md: no line '- **{LABEL[lang].format(id=ident, label=label)}'")
    assert not problems, "\n".join(problems)
