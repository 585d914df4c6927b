"""The tests' GGUF loader node (the pack's tests install it into the test ComfyUI's custom_nodes): "Unet Loader
(GGUF, test)" reads a .gguf file from models/diffusion_models with gguf-py, keeps every tensor as the file's
bytes (quant_ops.QuantTensor) and builds ComfyUI's model with the loader's operations - the contract of
ComfyUI-GGUF's UnetLoaderGGUF(Advanced), so that the pack's support for it is tested without the third-party pack."""
from __future__ import annotations

import warnings

import torch

import folder_paths

FOLDER = "hp_unet_gguf"  # .gguf files in ComfyUI's diffusion_models folders
folder_paths.folder_names_and_paths[FOLDER] = (list(folder_paths.get_folder_paths("diffusion_models")), {".gguf"})


def read_gguf(path: str) -> dict:
    """{name: QuantTensor} over the file's mapped bytes; a quantized tensor is its rows of blocks, a float one is
    viewed to its shape. The largest quantized tensor is marked for ComfyUI's memory estimate."""
    import gguf

    from .quant_ops import TORCH_TYPES, QuantTensor, is_quantized
    reader = gguf.GGUFReader(path)
    sd = {}
    for t in reader.tensors:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(t.data)
        shape = torch.Size(int(v) for v in reversed(t.shape))
        if t.tensor_type in TORCH_TYPES:
            data = data.view(*shape)
        sd[t.name] = QuantTensor(data, tensor_type=t.tensor_type, tensor_shape=shape)
    quantized = [k for k, v in sd.items() if is_quantized(v)]
    if quantized:
        sd[max(quantized, key=lambda k: sd[k].numel())].is_largest_weight = True
    return sd


class HPTestUnetLoaderGGUF:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "unet_name": (folder_paths.get_filename_list(FOLDER),),
            "dequant_dtype": (["default", "target", "float32", "float16", "bfloat16"], {"default": "default"}),
            "patch_on_device": ("BOOLEAN", {"default": False}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load_unet"
    CATEGORY = "testing"

    def load_unet(self, unet_name, dequant_dtype="default", patch_on_device=False):
        import comfy.sd

        from .quant_ops import QuantModelPatcher, QuantOps
        ops = QuantOps()
        # set on the class, as ComfyUI-GGUF does: every model loaded after this one dequantizes so too
        ops.Linear.dequant_dtype = None if dequant_dtype == "default" else \
            dequant_dtype if dequant_dtype == "target" else getattr(torch, dequant_dtype)
        sd = read_gguf(folder_paths.get_full_path(FOLDER, unet_name))
        model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops})
        if model is None:
            raise RuntimeError(f"could not detect the model type of {unet_name}")
        model = QuantModelPatcher.clone(model)
        model.patch_on_device = patch_on_device
        return (model,)


NODE_CLASS_MAPPINGS = {"HPTestUnetLoaderGGUF": HPTestUnetLoaderGGUF}
NODE_DISPLAY_NAME_MAPPINGS = {"HPTestUnetLoaderGGUF": "Unet Loader (GGUF, test)"}
