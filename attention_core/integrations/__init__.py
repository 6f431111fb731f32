"""attention_core.integrations: the engine inside other libraries, the way each of them chooses an attention.

Each submodule is imported on its own (`from attention_core.integrations import diffusers`) and imports its library
only then; importing this package imports nothing and changes nothing.
"""
