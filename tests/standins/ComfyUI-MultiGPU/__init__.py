"""A stand-in of pollockjj/ComfyUI-MultiGPU's device-choosing loaders (UNETLoaderMultiGPU), the tests' own code written
to its mechanism (read in its public code): at import it wraps comfy.model_management's device function so that a
loader can name the device ComfyUI loads a model to, and its loader node is ComfyUI's UNETLoader with a `device`
input, run while that device is chosen. tests/server_e2e/test_other_pack_samplers.py puts it in front of Parallel
Model."""
import comfy.model_management as mm
import nodes

_CHOSEN = {"device": None}
_original = mm.get_torch_device


def get_torch_device():
    """ComfyUI's device, or the one a MultiGPU loader chose while it loads."""
    return _CHOSEN["device"] if _CHOSEN["device"] is not None else _original()


mm.get_torch_device = get_torch_device  # module-wide, at import, as the real pack patches model_management


class UNETLoaderMultiGPU:
    @classmethod
    def INPUT_TYPES(cls):
        base = nodes.UNETLoader.INPUT_TYPES()
        return {"required": {**base["required"], "device": (["cpu"],)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load_unet"
    CATEGORY = "multigpu"

    def load_unet(self, device, **kwargs):
        import torch
        _CHOSEN["device"] = torch.device(device)
        try:
            return nodes.UNETLoader().load_unet(**kwargs)
        finally:
            _CHOSEN["device"] = None


NODE_CLASS_MAPPINGS = {"UNETLoaderMultiGPU": UNETLoaderMultiGPU}
