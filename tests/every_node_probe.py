"""Run every ComfyUI node that outputs a MODEL, GUIDER or CONDITIONING on a tiny model and say what the pack's capture
decides for what it added (tests/driver/test_every_node.py runs this in its own process and checks the answers against
workers/bridge/classified.py).

In its own process because it loads every node module of ComfyUI (and of the third-party packs installed in the venv,
scripts/setup_thirdparty.sh) the way the server does, which the test session must not inherit. Each node runs once
through ComfyUI's own executor code on the tiny SD3 (its required widgets at their defaults, its model / conditioning
/ latent / hook inputs made here); a node that fails on SD3 is tried on a tiny Wan 2.1, SD1.5 UNet and LTX-Video.
Prints one JSON object: {class_type: {"verdict", "family", "found": [...]} or {"skipped": why}}.

    python tests/every_node_probe.py [--only A,B] [OUT.json]
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAMILIES = ("sd3", "wan", "sd15", "ltxv")
OUTPUTS = ("MODEL", "GUIDER", "CONDITIONING")
# nodes that do nothing on SD3 (ComfyUI's own no-op) but act on another family: judged there
FIRST_FAMILY = {"UNetCrossAttentionMultiply": "sd15", "UNetSelfAttentionMultiply": "sd15",
                "UNetTemporalAttentionMultiply": "sd15", "FreeU": "sd15", "FreeU_V2": "sd15",
                "PerturbedAttentionGuidance": "sd15", "SelfAttentionGuidance": "sd15"}
# widgets whose default leaves the node a no-op (it returns its MODEL as it came): the value the probe runs it with
NOT_DEFAULT = {"ApplyFBCacheOnModel": {"residual_diff_threshold": 0.12}}
CTX = {"sd3": 32, "wan": 4096, "sd15": 768, "ltxv": 4096}
LATENT = {"sd3": (1, 16, 8, 8), "wan": (1, 16, 2, 8, 8), "sd15": (1, 4, 8, 8), "ltxv": (1, 128, 2, 2, 2)}


class NeedInput(Exception):
    pass


def load_comfy():
    sys.path.insert(0, str(HERE))
    from comfy_env import comfy_nodes, setup_comfy
    comfy_dir = setup_comfy()
    nodes = comfy_nodes(comfy_dir)
    import server  # ComfyUI's: packs (KJNodes) read PromptServer.instance when they load; a stand-in then
    from unittest import mock
    stub = mock.MagicMock()
    stub.app.router.frozen = True
    server.PromptServer.instance = stub
    try:
        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
        base = set(nodes.NODE_CLASS_MAPPINGS)
        from comfy_server import third_party  # the real packs given by hand, else the tests' stand-ins of them
        for pack in third_party():
            if pack.name.startswith("hp_"):  # the tests' own test nodes (in-place patches, tiled samplers): not a pack
                continue
            asyncio.run(nodes.load_custom_node(str(pack), base, module_parent="custom_nodes"))
    finally:
        server.PromptServer.instance = None
    return nodes


def write_models(tmp: Path) -> dict:
    import folder_paths
    import torch
    from safetensors.torch import save_file

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    (tmp / "dm").mkdir()
    files = {f: tmp / "dm" / f"tiny_{f}.safetensors" for f in FAMILIES}
    tc.write_sd3(files["sd3"], depth=2, pos_embed_max_size=48, seed=3)
    tc.write_wan(files["wan"], seed=3)
    tc.write_unet(files["sd15"], seed=3, dtype=torch.float32)
    tc.write_ltxv(files["ltxv"], seed=3)
    g = torch.Generator().manual_seed(9)
    lora = {}
    for i in range(2):
        k = f"diffusion_model.joint_blocks.{i}.x_block.attn.qkv"
        lora[f"{k}.lora_up.weight"] = torch.randn(3 * 128, 4, generator=g) * 0.2
        lora[f"{k}.lora_down.weight"] = torch.randn(4, 128, generator=g) * 0.2
    (tmp / "loras").mkdir()
    save_file(lora, str(tmp / "loras" / "tiny_lora.safetensors"))
    folder_paths.add_model_folder_path("loras", str(tmp / "loras"), is_default=True)
    folder_paths.add_model_folder_path("diffusion_models", str(tmp / "dm"), is_default=True)
    from comfyui_hybrid_parallel.doctor import tiny_vaes
    files["vae"] = tmp / "tiny_wan_vae.safetensors"
    tiny_vaes.write_wan_vae(files["vae"], dim=8, seed=5)
    files["lora"] = tmp / "loras" / "tiny_lora.safetensors"
    return files


class StubCLIP:
    """A CLIP for text-encode nodes: their tokens become a random conditioning of the family's width (what they add
    to it besides is what is judged); no hooks of its own."""

    def __init__(self, ctx):
        self.ctx, self.patcher, self.layer_idx, self.use_clip_schedule, self.tokenizer_options = ctx, None, None, \
            False, {}

    def tokenize(self, text, return_word_ids=False, **kwargs):
        class AnyKey(dict):  # every encoder name a node asks for (l, g, t5xxl, ...)
            def __missing__(self, k):
                return [[(1, 1.0)] * 3]
        return AnyKey(stub=[[(1, 1.0)] * 3])

    def encode_from_tokens_scheduled(self, tokens, unprojected=False, add_dict={}, show_pbar=True):
        import torch
        return [[torch.randn(1, 7, self.ctx), {"pooled_output": torch.randn(1, 24), **add_dict}]]

    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
        import torch
        c, p = torch.randn(1, 7, self.ctx), torch.randn(1, 24)
        if return_dict:
            return {"cond": c, "pooled_output": p}
        return (c, p) if return_pooled else c

    def clone(self):
        return self

    def set_tokenizer_option(self, *a, **k):
        pass

    def get_key_patches(self):
        return {}


class Inputs:
    def __init__(self, files):
        self.files, self._vae, self._controlnet = files, None, None

    def model(self, family):
        import comfy.sd
        return comfy.sd.load_diffusion_model(str(self.files[family]))

    def cond(self, family):
        import torch
        return [[torch.randn(1, 7, CTX[family]), {"pooled_output": torch.randn(1, 24)}]]

    def make(self, t: str, family: str, name: str, opts: dict):
        import torch
        if t == "MODEL":
            return self.model(family)
        if t == "CONDITIONING":
            return self.cond(family)
        if t == "LATENT":
            return {"samples": torch.zeros(LATENT[family])}
        if t == "MASK":
            return torch.ones(1, 64, 64)
        if t == "IMAGE":
            return torch.rand(1, 64, 64, 3)
        if t == "HOOKS":
            import comfy.hooks
            import comfy.utils
            return comfy.hooks.create_hook_lora(comfy.utils.load_torch_file(str(self.files["lora"])), 1.0, 1.0)
        if t == "VAE":
            if self._vae is None:
                import comfy.sd
                import comfy.utils
                self._vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(self.files["vae"])))
            return self._vae
        if t == "CLIP":
            return StubCLIP(CTX[family])
        if t == "CONTROL_NET":
            if self._controlnet is None:
                import comfy.controlnet
                from comfyui_hybrid_parallel.doctor import tiny_controlnets
                path = Path(self.files["vae"]).parent / "tiny_sd3_controlnet.safetensors"
                tiny_controlnets.write_sd3_controlnet(path, depth=2, num_blocks=1, pos_embed_max_size=48, seed=4)
                self._controlnet = comfy.controlnet.load_controlnet(str(path))
            return self._controlnet
        if t == "CLIP_VISION_OUTPUT":
            import comfy.clip_vision
            o = comfy.clip_vision.Output()
            o.last_hidden_state, o.penultimate_hidden_states = torch.randn(1, 257, 1280), torch.randn(1, 257, 1280)
            o.image_embeds, o.mm_projected, o.image_sizes = torch.randn(1, 1024), torch.randn(1, 729, 4096), [(64, 64)]
            return o
        if t == "HOOK_KEYFRAMES":
            import comfy.hooks
            g = comfy.hooks.HookKeyframeGroup()
            g.add(comfy.hooks.HookKeyframe(strength=0.5, start_percent=0.0))
            return g
        if t == "TIMESTEPS_RANGE":
            return (0.0, 1.0)
        if t == "SIGMAS":
            return torch.linspace(1.0, 0.0, 5)
        if t == "COMFY_DYNAMICCOMBO_V3":
            return opts["options"][0]["key"]
        default = opts.get("default", opts.get("min"))
        if t == "INT":
            if not isinstance(default, (int, float)):
                raise NeedInput(t)
            v = int(default)
            return min(v, 64) if name in ("width", "height") else min(v, 5) if name in ("length",) else \
                1 if name == "batch_size" else v
        if t == "FLOAT":
            if not isinstance(default, (int, float)):
                raise NeedInput(t)
            return float(default)
        if t == "BOOLEAN":
            return bool(opts.get("default", False))
        if t == "STRING":
            return opts.get("default", "")
        if t == "COMBO":
            return _option(list(opts.get("options") or []))
        raise NeedInput(t)


def _option(options):
    if not options:
        raise NeedInput("COMBO(empty)")
    return options[0]


def build(cls, inputs: Inputs, family: str):
    from comfy_api.latest import _io
    d = cls.INPUT_TYPES()
    live, need = {}, []
    is_v3 = hasattr(cls, "GET_SCHEMA")
    if is_v3:
        for section in ("required", "optional"):
            for name, spec in (d.get(section) or {}).items():
                if isinstance(spec, (list, tuple)) and spec and str(spec[0]) == "COMFY_DYNAMICCOMBO_V3":
                    live[name] = spec[1]["options"][0]["key"]
        d, _, _ = _io.get_finalized_class_inputs(d, live)
    for name, spec in (d.get("required") or {}).items():
        if name in live:
            continue
        if name in NOT_DEFAULT.get(cls.__name__, {}):
            live[name] = NOT_DEFAULT[cls.__name__][name]
            continue
        t = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
        opts = spec[1] if isinstance(spec, (list, tuple)) and len(spec) > 1 and isinstance(spec[1], dict) else {}
        try:
            live[name] = _option(list(t)) if isinstance(t, (list, tuple)) else inputs.make(str(t), family, name, opts)
        except NeedInput as e:
            need.append(f"{name}:{e}")
    return live, need


async def call(cls, live):
    import execution
    obj = cls()
    data, _, v3 = execution.get_input_data(live, cls, "1")
    rv = await execution._async_map_node_over_list("probe", "1", obj, data, obj.FUNCTION, allow_interrupt=False,
                                                  v3_data=v3)
    rv = await execution.resolve_map_node_over_list_results(rv)
    output, _, _ = execution.get_output_from_returns(rv, obj)
    return output


def output_types(cls) -> list:
    return [str(t) for t in (getattr(cls, "RETURN_TYPES", None) or ())]


def judge(cls, outputs, inputs: Inputs, family: str) -> dict:
    """The capture's findings on each MODEL / GUIDER / CONDITIONING output, in step mode and in the workers' loop."""
    from comfyui_hybrid_parallel.workers.bridge.capture import capture
    from comfyui_hybrid_parallel.workers.bridge.known import CARRIED, REFUSED
    found, verdicts = [], set()
    for t, values in zip(output_types(cls), outputs):
        if t not in OUTPUTS:
            continue
        for value in values if isinstance(values, list) else [values]:
            caps = {}
            for mode in ("step", "loop"):
                if t == "MODEL":
                    caps[mode] = capture(value, mode)
                elif t == "GUIDER":
                    caps[mode] = capture(value.model_patcher, mode, model_options=value.model_options,
                                         conds=value.original_conds)
                else:
                    caps[mode] = capture(inputs.model(family), mode, conds={"positive": value})
            step, loop = caps["step"].verdicts(), caps["loop"].verdicts()
            for (f, vs), (_, vl) in zip(step, loop):
                found.append({"what": f.what, "origin": f.origin, "step": vs, "loop": vl})
            if any(v == REFUSED for _, v in step):
                verdicts.add("refused")
            elif any(v == CARRIED for _, v in step + loop):  # (the loop alone: EasyCache's rule on the workers)
                verdicts.add("carried")
            elif any(v == REFUSED for _, v in loop):
                verdicts.add("step")
    verdict = next((v for v in ("refused", "carried", "step") if v in verdicts), "plain")
    return {"verdict": verdict, "family": family, "found": found}


def main(argv):
    only = set()
    if "--only" in argv:
        i = argv.index("--only")
        only = set(argv[i + 1].split(","))
        argv = argv[:i] + argv[i + 2:]
    import torch
    torch.set_num_threads(1)
    nodes = load_comfy()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hp-every-node-") as tmp:
        inputs = Inputs(write_models(Path(tmp)))
        for class_type, cls in sorted(nodes.NODE_CLASS_MAPPINGS.items()):
            if not set(output_types(cls)) & set(OUTPUTS) or (only and class_type not in only):
                continue
            if class_type.startswith("Hybrid"):
                continue  # the pack's own nodes
            errors = []
            first = FIRST_FAMILY.get(class_type)
            for family in ((first,) if first else ()) + tuple(f for f in FAMILIES if f != first):
                live, need = build(cls, inputs, family)
                if need:
                    results[class_type] = {"skipped": f"needs inputs {need}"}
                    break
                try:
                    outputs = asyncio.run(call(cls, live))
                    results[class_type] = judge(cls, outputs, inputs, family)
                    break
                except Exception as e:  # noqa: BLE001 - a node for another family: the next one
                    errors.append(f"{family}: {type(e).__name__}: {str(e)[:160]}")
                    if os.environ.get("HP_PROBE_TRACE"):
                        traceback.print_exc()
            else:
                results[class_type] = {"skipped": "fails on every tiny family: " + " | ".join(errors)}
    text = json.dumps(results, indent=1, sort_keys=True)
    if argv[1:]:
        Path(argv[1]).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main(sys.argv)
