"""Adapters that put the engine into other libraries' own attention registries, one module per library.

    attention_core.integrations.transformers   register(): attn_implementation="tiled" in Hugging Face transformers

Importing this package imports nothing heavy and changes nothing: each library's module registers on import of that
module (or on its explicit register()), never on `import attention_core` or `import attention_core.integrations`.
"""
