"""Example-only ComfyUI nodes for the pack's headless demo and tests.

No text-encoder weights can be downloaded here, so these supply conditioning: the demo
model's own text encoder (demo_text.py), or tensors of the right shapes (seeded random)
for the tiny random-init test models; and they save IMAGE tensors losslessly
(safetensors) so a workflow's result can be compared exactly with a reference.
Not needed to use the pack with real models.
"""
import os

import torch

from . import demo_text


class HPExampleConditioning:
    CATEGORY = "hybrid parallel/examples"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    DESCRIPTION = "Seeded random text conditioning of a given shape (stands in for a text encoder)."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
            "tokens": ("INT", {"default": 8, "min": 1, "max": 4096}),
            "context_dim": ("INT", {"default": 32, "min": 1, "max": 8192}),
            "pooled_dim": ("INT", {"default": 0, "min": 0, "max": 8192, "tooltip": "0 = no pooled output"}),
            "guidance": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 100.0, "tooltip": "-1 = none"}),
        }, "optional": {
            "padded": ("INT", {"default": 0, "min": 0, "max": 4096, "tooltip": "> 0: an attention mask (as T5 "
                               "encoders give LTX-Video) whose last `padded` tokens are padding"}),
        }}

    def make(self, seed, tokens, context_dim, pooled_dim, guidance, padded=0):
        g = torch.Generator().manual_seed(seed)
        extra = {}
        if padded:
            mask = torch.ones(1, tokens, dtype=torch.int64)
            mask[:, tokens - min(padded, tokens - 1):] = 0
            extra["attention_mask"] = mask
        if pooled_dim:
            extra["pooled_output"] = torch.randn(1, pooled_dim, generator=g)
        if guidance >= 0:
            extra["guidance"] = guidance
        return ([[torch.randn(1, tokens, context_dim, generator=g), extra]],)


class HPDemoTextEncode:
    CATEGORY = "hybrid parallel/examples"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    DESCRIPTION = ("The demo model's text encoder (examples/demo_model): fixed pseudo-random word vectors, no "
                   "weights. The demo model draws 'a <colour> <shape> on a <background> background'.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"default": "a red circle on a gray background",
                                                 "tooltip": "Empty = the unconditional (negative) prompt."})}}

    def encode(self, text):
        context, pooled = demo_text.encode(text)
        return ([[context, {"pooled_output": pooled}]],)


class HPSaveImageTensor:
    CATEGORY = "hybrid parallel/examples"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    DESCRIPTION = "Save an IMAGE losslessly as output/<filename>.safetensors (for exact comparisons)."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",), "filename": ("STRING", {"default": "image"})}}

    def save(self, images, filename):
        import folder_paths
        from safetensors.torch import save_file

        out_dir = folder_paths.get_output_directory()
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{filename}.safetensors")
        save_file({"images": images.contiguous().cpu()}, path)
        return {"ui": {"text": [path]}}


class HPSaveLatentTensor(HPSaveImageTensor):
    DESCRIPTION = "Save a LATENT's samples losslessly as output/<filename>.safetensors."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "filename": ("STRING", {"default": "latent"})}}

    def save(self, samples, filename):
        s = samples["samples"]
        if getattr(s, "is_nested", False):  # a multi-stream latent (video + audio): every stream, flattened in order
            s = torch.cat([t.reshape(-1) for t in s.unbind()])
        return super().save(s, filename)


NODE_CLASS_MAPPINGS = {"HPExampleConditioning": HPExampleConditioning, "HPDemoTextEncode": HPDemoTextEncode,
                       "HPSaveImageTensor": HPSaveImageTensor,
                       "HPSaveLatentTensor": HPSaveLatentTensor}
NODE_DISPLAY_NAME_MAPPINGS = {"HPExampleConditioning": "Example Conditioning (random)",
                              "HPDemoTextEncode": "Demo Text Encode (demo model)",
                              "HPSaveImageTensor": "Save Image Tensor (lossless)",
                              "HPSaveLatentTensor": "Save Latent Tensor (lossless)"}
