"""What a bundled workflow makes, read from the workflow JSON itself: model (from its diffusion model files), task,
output size, frames, frame rate, audio, sampling stages and experts. The template cards (tools/template_cards.py) draw these facts and
name each workflow file after them, so a card and a file name can never say something the graph does not do.

``workflow_facts(workflow)`` returns a ``WorkflowFacts``; a graph it cannot read (no latent-size node, an
unknown model file, no Patch Attention on it) raises ``ValueError`` naming what is missing, so a new or changed
workflow fails loudly instead of getting a wrong card.

Output size: the latent node's width x height (``Wan22ImageToVideoLatent``, ``EmptyLTXVLatentVideo``,
``EmptyHunyuanLatentVideo`` and ``WanImageToVideo`` of Wan 14B, ``EmptySD3LatentImage`` of an image), times the
factor of a latent upscaler that is in the graph (the ``x2`` of ``ltx-2.3-spatial-upscaler-x2-1.1``), then an
``ImageCrop`` if there is one (the 1080p workflow samples 1920x1088 and crops to 1920x1080). Duration =
frames / fps of ``CreateVideo``. An image workflow (a ``SaveImage`` and no ``CreateVideo``) is "Text to Image" with
1 frame and fps 0. Experts: the diffusion model files a workflow samples with one after the other (Wan 2.2 A14B: a
high-noise and a low-noise expert, each with its own sampler); every diffusion loader must name the same model.
"""
import re
from dataclasses import dataclass

# model files the bundled workflows sample with -> (the model as titles name it, as the cards name it); titles
# follow ComfyUI's own templates ("Wan 2.2 5B Video Generation", "LTX-2.3: Text to Video")
MODEL_NAMES = (
    (re.compile(r"^wan2\.2_ti2v_5B_"), ("Wan 2.2 5B", "Wan 2.2 TI2V 5B")),
    (re.compile(r"^ltx-2\.3-22b-"), ("LTX-2.3", "LTX-2.3 22B")),
    (re.compile(r"^wan2\.2_[ti]2v_(high|low)_noise_14B_"), ("Wan 2.2 14B", "Wan 2.2 A14B")),
    (re.compile(r"^z_image_turbo_"), ("Z-Image Turbo", "Z-Image Turbo 6B")),
)
DIFFUSION_LOADERS = {"UNETLoader": "unet_name", "CheckpointLoaderSimple": "ckpt_name"}
LATENT_SIZE_NODES = ("Wan22ImageToVideoLatent", "EmptyLTXVLatentVideo", "EmptyHunyuanLatentVideo",
                     "WanImageToVideo")  # widgets: width, height, length, ...
IMAGE_LATENT_NODES = ("EmptySD3LatentImage",)  # widgets: width, height, batch_size
SAMPLER_NODES = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced")
UPSCALE_FACTOR_RE = re.compile(r"-x(\d+(?:\.\d+)?)-")
STANDARD_HEIGHTS = (480, 720, 1080)


@dataclass(frozen=True)
class WorkflowFacts:
    model: str            # "Wan 2.2 5B": as the title names it
    model_long: str       # "Wan 2.2 TI2V 5B": as the card names it
    task: str             # "Text to Video" / "Image to Video"
    audio: bool           # the saved video carries a generated sound track
    width: int            # of the saved video
    height: int
    frames: int
    fps: float
    stages: int           # sampling passes (LTX-2.3: half size, then the upscaled refine)
    upscale: float        # the latent upscaler's factor between the passes (1 when there is none)
    experts: int = 1      # diffusion models sampled one after the other (Wan 2.2 A14B: high noise, then low)

    @property
    def image(self):
        return self.task.endswith("Image")

    @property
    def seconds(self):
        return self.frames / self.fps

    @property
    def resolution(self):
        """The nearest standard video height as "480p" / "720p" / "1080p" (1280x704 is 720p); an image's
        width x height ("1024x1024")."""
        if self.image:
            return f"{self.width}x{self.height}"
        return f"{min(STANDARD_HEIGHTS, key=lambda h: abs(h - min(self.width, self.height)))}p"


def _nodes(workflow, ntype):
    return [n for n in workflow["nodes"] if n["type"] == ntype and n.get("mode", 0) == 0]


def _one(workflow, ntypes):
    found = [n for t in ntypes for n in _nodes(workflow, t)]
    if len(found) != 1:
        raise ValueError(f"expected exactly one of {', '.join(ntypes)}, found {len(found)}")
    return found[0]


def _linked(node, input_name):
    return any(i["name"] == input_name and i.get("link") is not None for i in node.get("inputs") or [])


def _family(name):
    for pattern, family in MODEL_NAMES:
        if pattern.search(name):
            return family
    raise ValueError(f"unknown diffusion model file {name!r}: add its names to MODEL_NAMES in {__name__}")


def _model(workflow):
    """(family, experts): the model all diffusion loaders name, and how many there are."""
    loaders = [n for t in DIFFUSION_LOADERS for n in _nodes(workflow, t)]
    if not loaders:
        raise ValueError(f"expected a diffusion model loader ({', '.join(DIFFUSION_LOADERS)}), found none")
    families = {_family(n["widgets_values"][0]) for n in loaders}
    if len(families) != 1:
        raise ValueError(f"diffusion loaders of different models: {sorted(f[0] for f in families)}")
    return families.pop(), len(loaders)


def _output_size(workflow):
    latent = _one(workflow, LATENT_SIZE_NODES + IMAGE_LATENT_NODES)
    width, height, frames = latent["widgets_values"][:3]
    if latent["type"] in IMAGE_LATENT_NODES:
        frames = 1
    factor = 1.0
    for node in _nodes(workflow, "LatentUpscaleModelLoader"):
        match = UPSCALE_FACTOR_RE.search(node["widgets_values"][0])
        if not match:
            raise ValueError(f"latent upscaler {node['widgets_values'][0]!r} names no -xN- factor")
        factor = float(match.group(1))
        width, height = int(width * factor), int(height * factor)
    crops = _nodes(workflow, "ImageCrop")
    if crops:
        width, height = _one(workflow, ("ImageCrop",))["widgets_values"][:2]
    return width, height, frames, factor


def workflow_facts(workflow):
    """The facts of one UI-format workflow (a dict as json.load gives it)."""
    if not _nodes(workflow, "TiledAttentionPatch"):
        raise ValueError("no active Patch Attention (TiledAttentionPatch) node: not a tiled-attention workflow")
    (model, model_long), experts = _model(workflow)
    width, height, frames, upscale = _output_size(workflow)
    images = [n for n in _nodes(workflow, "LoadImage") if n.get("outputs") and n["outputs"][0].get("links")]
    stages = sum(len(_nodes(workflow, t)) for t in SAMPLER_NODES)
    if not _nodes(workflow, "CreateVideo") and _nodes(workflow, "SaveImage"):
        return WorkflowFacts(model=model, model_long=model_long, task="Image to Image" if images else "Text to Image",
                             audio=False, width=int(width), height=int(height), frames=1, fps=0.0, stages=stages,
                             upscale=upscale, experts=experts)
    video = _one(workflow, ("CreateVideo",))
    return WorkflowFacts(
        model=model, model_long=model_long, task="Image to Video" if images else "Text to Video",
        audio=_linked(video, "audio"), width=int(width), height=int(height), frames=int(frames),
        fps=float(video["widgets_values"][0]), stages=stages, upscale=upscale, experts=experts)


def template_title(facts):
    """The title a person reads in ComfyUI's Templates browser, which is the workflow's file name (without
    .json) for a custom node pack's templates: "Wan 2.2 5B Text to Video 480p", "Z-Image Turbo Image 1024x1024"
    (an image workflow's task is shortened: the card says "Text → Image", and the browser clips a title past about 31
    characters). ASCII letters, digits, spaces,
    dots and hyphens only: the name travels unescaped through the server's listing, the frontend's template
    URLs, git, zip archives and Windows file systems."""
    task = {"Text to Image": "Image", "Image to Image": "Image Edit"}.get(facts.task, facts.task)
    return f"{facts.model} {task} {facts.resolution}"
