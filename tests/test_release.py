"""The release's facts agree: one version (pyproject.toml) read by the package, named at the top of CHANGELOG.md in
Keep a Changelog form; the registry fields (icon, URLs) filled and the icon the one tools/icon.py draws."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def load_version_module():
    import importlib.util  # attention_core/version.py alone: no torch needed
    spec = importlib.util.spec_from_file_location("_version", ROOT / "attention_core" / "version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_reads_pyproject_s_version():
    assert load_version_module().version() == pyproject()["project"]["version"]


def test_only_the_project_table_s_version_counts(tmp_path):
    f = tmp_path / "pyproject.toml"
    f.write_text('[tool.other]\nversion = "9.9.9"\n\n[project]\nname = "tiled-attention"\nversion = "1.2.3"\n[tool.x]\nversion = "0"\n')
    assert load_version_module().from_pyproject(str(f)) == "1.2.3"
    assert load_version_module().from_pyproject(str(tmp_path / "none.toml")) is None


def test_changelog_names_the_version_first_in_keep_a_changelog_form():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    entries = ENTRY.findall(text)
    assert entries and entries[0][0] == pyproject()["project"]["version"], "CHANGELOG.md's first entry is the version"
    versions = [tuple(map(int, v.split("."))) for v, _ in entries]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), versions
    assert [d for _, d in entries] == sorted((d for _, d in entries), reverse=True)
    kinds = set(re.findall(r"^### (.+)$", text, re.M))
    assert kinds <= KINDS, kinds - KINDS


def test_registry_fields_are_filled():
    meta = pyproject()
    urls = meta["project"]["urls"]
    for key in ("Homepage", "Documentation", "Repository", "Issues"):  # what the Comfy Registry reads
        assert urls.get(key, "").startswith("https://"), key
    icon = meta["tool"]["comfy"]["Icon"]
    assert icon.startswith("https://") and icon.endswith("/docs/icon.png"), icon


def test_the_icon_is_square_and_the_one_the_script_draws():
    from PIL import Image

    from tools import icon
    with Image.open(ROOT / "docs" / "icon.png") as img:
        assert img.format == "PNG" and img.size[0] == img.size[1] >= 200, img.size
    assert icon.main(["--check"]) == 0
