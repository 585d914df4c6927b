"""CFG-Zero* with zero init (arXiv 2503.18886) as a CFG function on the denoised outputs, to the interface of KJNodes'
CFGZeroStarAndInit (inputs model, use_zero_init, zero_init_steps). Written for the tests from the paper's rule:
the unconditional prediction is scaled by the projection of the conditional one on it before the usual guidance,
and the first steps' output is zero."""
import torch


def _step_index(sigmas, sigma) -> int:
    """Which step of the sampler's schedule `sigma` is in (the interval holding it)."""
    hits = torch.nonzero(sigmas == sigma)
    if len(hits):
        return int(hits[0])
    for i in range(len(sigmas) - 1):
        if (sigmas[i] - sigma) * (sigmas[i + 1] - sigma) <= 0:
            return i
    return 0


class CFGZeroStarAndInit:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "use_zero_init": ("BOOLEAN", {"default": True}),
                             "zero_init_steps": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "KJNodes/experimental"

    def patch(self, model, use_zero_init, zero_init_steps):
        def guidance(args):
            cond, uncond, scale = args["cond"], args["uncond"], args["cond_scale"]
            sigmas = args["model_options"]["transformer_options"]["sample_sigmas"]
            if use_zero_init and _step_index(sigmas, args["timestep"][0]) <= zero_init_steps:
                return torch.zeros_like(cond)
            b = cond.shape[0]
            c, u = cond.reshape(b, -1), uncond.reshape(b, -1)
            alpha = (c * u).sum(1, keepdim=True) / ((u * u).sum(1, keepdim=True) + 1e-8)
            alpha = alpha.reshape(b, *([1] * (cond.dim() - 1)))
            return uncond * alpha + scale * (cond - uncond * alpha)

        m = model.clone()
        m.set_model_sampler_cfg_function(guidance)
        return (m,)
