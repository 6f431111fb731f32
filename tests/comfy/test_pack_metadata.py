"""What a Manager / registry / pip install of the pack brings (pyproject.toml, requirements.txt), checked offline
with the rules of the registry's own check (`comfy node validate`, comfy-cli registry/config_parser.py): accelerator
classifiers from its fixed list (anything else makes it drop all accelerators with a warning), an OS classifier it
knows, a `requires-comfyui` it can parse; and both files agree, without torch or a frontend package."""
import ast
import os
import re
import tomllib

from tools.comfyui_setup.comfyui import ROOT

# comfy-cli 1.23.0, registry/config_parser.py: validate_and_extract_accelerator_classifiers / _os_classifiers
REGISTRY_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                         "GPU :: Apple Metal"}
REGISTRY_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
REGISTRY_VERSION = re.compile(r"^(?:(==|>=|<=|!=|~=|>|<|<>|=)\s*)?(\d+\.\d+\.\d+(?:-[a-zA-Z0-9]+)?)?$")


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def requirement_names(lines):
    names = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_pyproject_and_requirements_bring_the_same_and_never_torch():
    deps = requirement_names(pyproject()["project"]["dependencies"])
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:
        reqs = requirement_names(f)
    assert sorted(deps) == sorted(reqs)
    for forbidden in ("torch", "torchvision", "torchaudio", "comfyui-frontend-package"):
        assert forbidden not in deps, forbidden


def test_classifiers_are_ones_the_registry_records():
    classifiers = pyproject()["project"]["classifiers"]
    accelerators = [c[len("Environment :: "):] for c in classifiers if c.startswith("Environment ::")]
    assert accelerators and set(accelerators) <= REGISTRY_ACCELERATORS, accelerators
    assert {"GPU :: AMD ROCm", "GPU :: NVIDIA CUDA"} <= set(accelerators)
    systems = [c[len("Operating System :: "):] for c in classifiers if c.startswith("Operating System ::")]
    assert systems and all(s.startswith(REGISTRY_OS_PREFIXES) for s in systems), systems


def test_registry_fields():
    comfy = pyproject()["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    for part in comfy["requires-comfyui"].split(","):
        assert REGISTRY_VERSION.match(part.strip()), comfy["requires-comfyui"]
    for folder in comfy.get("includes", []):
        assert os.path.isdir(os.path.join(ROOT, folder)), folder


def test_only_workflows_is_a_folder_comfyui_serves_templates_from():
    """ComfyUI (app/custom_node_manager.py, 0.3.75 and 0.33.0) serves a pack's templates from the FIRST of
    example_workflows, example, examples, workflow, workflows that exists in the pack's folder: a top-level
    `examples/` (as the LoRA training script once lived in) hid every card picture behind a 404. The list is read
    from the test ComfyUIs' own source."""
    from tools.comfyui_setup.comfyui import comfy_path
    names = None
    for version in ("0.3.75", "0.33.0"):
        path = comfy_path(version)
        if path is None:
            continue
        with open(os.path.join(path, "app", "custom_node_manager.py"), encoding="utf-8") as f:
            found = re.search(r"example_workflow_folder_names\s*=\s*(\[[^\]]*\])", f.read())
        assert found, f"ComfyUI {version}: example_workflow_folder_names not found"
        names = set(names or ()) | set(ast.literal_eval(found.group(1)))
    names = names or {"example_workflows", "example", "examples", "workflow", "workflows"}
    present = sorted(n for n in names if os.path.isdir(os.path.join(ROOT, n)))
    assert present == ["workflows"], present
