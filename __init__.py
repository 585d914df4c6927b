"""ComfyUI entry point of the Hybrid Parallel node pack.

ComfyUI imports this folder as a package from custom_nodes/<any name>/; the
same folder is importable as `comfyui_hybrid_parallel` once installed
(`pip install -e .`). Everything below is imported relatively so the pack never
collides with ComfyUI's own top-level `nodes` module.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
