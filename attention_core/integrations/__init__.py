"""attention_core.integrations: the engine inside other libraries, the way each of them chooses an attention.

    attention_core.integrations.transformers   register(): attn_implementation="tiled" in Hugging Face transformers
    attention_core.integrations.diffusers      use_tiled() / reset() / tiled(): one diffusers model's attention

Each submodule is imported on its own and imports its library only then; importing this package imports nothing and
changes nothing (transformers' "tiled" is registered on import of that module or by its register(), never on
`import attention_core`).
"""
