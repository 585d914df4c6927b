"""A stand-in of kijai/ComfyUI-KJNodes (the registry's folder name comfyui-kjnodes): its CFGZeroStarAndInit node, in the
module path the real pack defines it in, so the pack's rule for it (workers/bridge/known.py) is exercised in CI.
The tests' own code; the real pack replaces this folder when given (HP_THIRDPARTY_DIR)."""
from .nodes.model_optimization_nodes import CFGZeroStarAndInit

NODE_CLASS_MAPPINGS = {"CFGZeroStarAndInit": CFGZeroStarAndInit}
