"""Samplers the way other packs sample a MODEL - the tests' own code, written to the mechanisms read in
ssitu/ComfyUI_UltimateSDUpscale (tiles of a latent sampled one by one, each at the upscaler's denoise), ltdrdata's
Impact Pack detailers and KSampler (pipe) and Inspire's KSampler, yolain/ComfyUI-Easy-Use's samplers (ComfyUI's
`common_ksampler` / `comfy.sample.sample` called from the node, several times in one prompt, at changing sizes).

HPTestTiledSampler: a 2 x 2 grid of tiles of unequal sizes, each sampled with its own seed and denoise (the last one
through nodes.common_ksampler, as Inspire / Easy-Use call it), pasted back over the input latent.
tests/server_e2e/test_other_pack_samplers.py compares it through Parallel Model with the same graph without the pack.
"""
import torch


class HPTestTiledSampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "positive": ("CONDITIONING",), "negative": ("CONDITIONING",),
                             "latent_image": ("LATENT",), "seed": ("INT", {"default": 0}),
                             "steps": ("INT", {"default": 3}), "cfg": ("FLOAT", {"default": 4.0})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "sample"
    CATEGORY = "hp_test"
    DENOISE = (0.35, 0.5, 0.7, 1.0)

    def sample(self, model, positive, negative, latent_image, seed, steps, cfg):
        import comfy.sample
        import nodes
        x = latent_image["samples"].clone()
        h, w = x.shape[-2:]
        rows, cols = [0, (h + 1) // 2, h], [0, w // 2 + 1, w]  # unequal tiles: e.g. 6 + 3 rows, 6 + 5 columns
        out = x.clone()
        tile = 0
        for r in range(2):
            for c in range(2):
                part = x[..., rows[r]:rows[r + 1], cols[c]:cols[c + 1]].contiguous()
                denoise = self.DENOISE[tile]
                if tile < 3:  # as Ultimate SD Upscale / the detailers: ComfyUI's sampling called from the node
                    noise = comfy.sample.prepare_noise(part, seed + tile)
                    done = comfy.sample.sample(model, noise, steps, cfg, "euler", "normal", positive, negative, part,
                                               denoise=denoise, seed=seed + tile)
                else:  # as Inspire / Easy-Use: ComfyUI's KSampler function
                    done = nodes.common_ksampler(model, seed + tile, steps, cfg, "euler", "normal", positive,
                                                 negative, {"samples": part}, denoise=denoise)[0]["samples"]
                out[..., rows[r]:rows[r + 1], cols[c]:cols[c + 1]] = done.to(out.dtype)
                tile += 1
        return ({"samples": out},)


NODE_CLASS_MAPPINGS = {"HPTestTiledSampler": HPTestTiledSampler}
