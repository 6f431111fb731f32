"""ComfyUI for the tests and the demo: which versions and where they live (comfyui.py), the 0.33.0 download
checked against its committed SHA-256 manifest (fetch_comfyui.py, `./dev fetch-comfyui`), a real server with the
pack installed (comfy_server.py), and bundled workflows turned into /prompt payloads (prompt_tools.py)."""
