"""The Tiled Attention Everywhere node: switches the process-wide mode (nodes/everywhere.py) from the graph and
shows its state."""
from __future__ import annotations

from . import everywhere
from .api import io


class TiledAttentionEverywhere(io.ComfyNode):
    NODE = "Tiled Attention Everywhere"

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="TiledAttentionEverywhere",
            display_name=cls.NODE,
            category="model_patches/attention",
            description=(
                "Switches the process-wide mode: every attention in this ComfyUI process, including packs with "
                "their own model code (WanVideoWrapper, diffusers and transformers based packs) and ComfyUI's "
                "global attention function, runs through exact tiled attention. It stays as set until switched "
                "again (also for later prompts, and for workflows without this node); the environment variable "
                f"{everywhere.ENV} sets it when ComfyUI starts. Models patched by Patch Attention keep the node's "
                "settings. Connect the model (or anything) through 'value' to switch before it runs."),
            inputs=[
                io.Combo.Input("mode", options=list(everywhere.MODES), default="auto", tooltip=(
                    "off: torch's and ComfyUI's own attention everywhere. auto: tiled attention where this GPU has "
                    "no fused attention (the same probe as Patch Attention's auto). chunked / inplace / online: "
                    "that tier on every device (chunked: fastest; inplace: less memory than chunked on a GPU; "
                    "online: least memory, and what runs when nothing else fits).")),
                io.Int.Input("min_tokens", default=everywhere.DEFAULT_MIN_TOKENS, min=0, max=1000000, tooltip=(
                    "Attention over fewer tokens than this (the longer of query and key) keeps torch's / "
                    "ComfyUI's own attention. 0 = every call runs tiled.")),
                io.AnyType.Input("value", optional=True, tooltip=(
                    "Optional pass-through (any type, e.g. a wrapper pack's model): wired in front of a loader or "
                    "sampler, the switch happens before that node runs.")),
            ],
            outputs=[io.AnyType.Output("passthrough", display_name="value", tooltip="The 'value' input, unchanged."),
                     io.String.Output("state", tooltip="The mode now in force and the attention calls counted.")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # always runs: the mode is process state, the output reports it now

    @classmethod
    def execute(cls, mode, min_tokens, value=None) -> io.NodeOutput:
        everywhere.set_mode(mode, int(min_tokens))
        text = everywhere.describe()
        return io.NodeOutput(value, text, ui={"text": [text]})
