"""FFN Chunking: MODEL -> MODEL with the blocks' feed-forward forwards run over token chunks (exact).

The replacement is a ModelPatcher object patch on `<ffn module>.forward`, so ComfyUI applies it when the
model loads and restores the original on unpatch; parameters and state-dict keys are untouched, so LoRAs
applied before or after this node still apply.
"""
from __future__ import annotations

import torch

from .api import io
from ..attention_core.ffn import ChunkedFFN
from ..attention_core.ffn.chunking import hidden_features
from .clones import register as follow_clones

# attribute names of token-wise feed-forwards in video DiTs: Wan `ffn`, LTX / LTX-2 `ff` and `audio_ff`,
# and the common generic names
FFN_NAMES = ("ffn", "ff", "audio_ff", "feed_forward", "mlp")


def find_ffn_modules(diffusion_model: torch.nn.Module) -> list:
    """Dotted paths of feed-forward modules inside the model's blocks (an FFN holds Linear layers and is not
    itself an attention module)."""
    found = []
    for name, module in diffusion_model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in FFN_NAMES or not name or "." not in name:
            continue
        if any(name.startswith(f + ".") for f in found):
            continue
        if hidden_features(module) > 0:
            found.append(name)
    return found


class FFNChunking(io.ComfyNode):
    NODE = "FFN Chunking"

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="TiledFFNChunking",
            display_name=cls.NODE,
            category="model_patches/attention",
            description=("Runs each transformer block's feed-forward over the tokens in chunks, so the wide hidden "
                         "activation (4x the model width, per token) never exists for the whole video at once. "
                         "Exact: a feed-forward treats every token alone (checked on the first call)."),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model (Wan, LTX, LTX-2 and other DiTs)."),
                io.Int.Input("chunks", default=0, min=0, max=1024, tooltip=(
                    "Chunks per feed-forward call. 0 = from free memory at each call (1 when it fits).")),
                io.Boolean.Input("enabled", default=True, tooltip="Off passes the model through unchanged."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, chunks, enabled) -> io.NodeOutput:
        return io.NodeOutput(chunk_model(model, chunks, enabled))


def chunk_model(model, chunks, enabled):
    """A clone of `model` with every block feed-forward wrapped in ChunkedFFN (object patches)."""
    m = model.clone()
    if not enabled:
        return m
    diffusion_model = m.get_model_object("diffusion_model")
    paths = find_ffn_modules(diffusion_model)
    if not paths:
        raise ValueError(f"FFN Chunking: no feed-forward modules ({', '.join(FFN_NAMES)}) found in "
                         f"{type(diffusion_model).__name__}; this node supports Wan, LTX and similar DiTs. "
                         f"Remove the node or set enabled=false for this model.")
    for path in paths:
        key = f"diffusion_model.{path}.forward"
        module = m.get_model_object(f"diffusion_model.{path}")
        original = m.get_model_object(key)  # the forward, or an earlier node's patch of it
        if isinstance(original, ChunkedFFN):  # a second FFN Chunking node: re-wrap the original
            original = original.forward
        m.add_object_patch(key, ChunkedFFN(original, chunks=int(chunks), dim=1,
                                           hidden=hidden_features(module), name=f"FFN Chunking ({path})"))
    follow_clones(m)
    return m
