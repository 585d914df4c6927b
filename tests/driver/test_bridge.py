"""The bridge's pieces on their own, in process (ComfyUI imported, no workers): the capture's channel walk and verdicts,
the per-call encoding of what travels and its rebuild, and the residency key.

The end-to-end proof is in a real server (tests/server_e2e/test_every_graph.py); these pin the rules a server test cannot reach
cheaply: a channel a later ComfyUI adds is refused, a plain object patch travels and is put back after the call, the
two block-replacement shapes are recognised by their code and nothing else is, and the key of resident weights
changes with every patch strength while ComfyUI's uuids are ignored."""
import pytest
import torch

from comfy_env import setup_comfy

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def patcher(tmp_path_factory):
    setup_comfy()
    import comfy.sd

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = tmp_path_factory.mktemp("bridge") / "tiny_sd3.safetensors"
    tc.write_sd3(path, depth=2, pos_embed_max_size=16, seed=1)
    return comfy.sd.load_diffusion_model(str(path))


def _verdicts(cap):
    return {f.what: v for f, v in cap.verdicts()}


def test_a_plain_model_carries_nothing(patcher):
    from comfyui_hybrid_parallel.workers.bridge.capture import capture, unknown_channels
    assert unknown_channels(patcher) == []
    for mode in ("step", "loop"):
        assert capture(patcher.clone(), mode).found == []


def test_a_new_channel_is_refused_until_classified(patcher):
    from comfyui_hybrid_parallel.workers.bridge.capture import NotCarried, capture
    m = patcher.clone()
    m.some_future_channel = {"key": lambda x: x}  # what a later ComfyUI's ModelPatcher might add
    cap = capture(m, "step")
    assert [f.what for f in cap.refused()] == ["ModelPatcher.some_future_channel (a channel of a ComfyUI newer than "
                                               "the pack knows)"]
    with pytest.raises(NotCarried, match="Parallel Model cannot run this graph.*some_future_channel"):
        cap.check("Parallel Model")


def test_object_patches_by_where_they_act(patcher):
    from comfyui_hybrid_parallel.workers.bridge.capture import capture
    from comfyui_hybrid_parallel.workers.bridge.carry import object_values
    m = patcher.clone()
    m.add_object_patch("diffusion_model.some_flag", "on")        # a plain value on the diffusion model: travels
    m.add_object_patch("concat_keys", ("concat_image",))         # the BaseModel's own: read in the driver
    m.add_object_patch("diffusion_model.final_layer", torch.nn.Identity())  # a swapped module: refused
    cap = capture(m, "step")
    got = _verdicts(cap)
    assert got == {"object patch 'diffusion_model.some_flag'": "carried", "object patch 'concat_keys'": "driver",
                   "object patch 'diffusion_model.final_layer'": "refused"}, got
    assert object_values(cap.carried("object_values")) == {"some_flag": "on"}


def test_object_values_are_set_for_the_call_and_put_back():
    from comfyui_hybrid_parallel.workers.bridge.carry import ObjectValues
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].mode = "default"
    model.flag = 1
    with ObjectValues(model, {"0.mode": "index_timestep_zero", "flag": 3}):
        assert model[0].mode == "index_timestep_zero" and model.flag == 3
    assert model[0].mode == "default" and model.flag == 1


def test_block_replacements_travel_only_in_their_two_known_shapes():
    from comfyui_hybrid_parallel.workers.bridge.capture import NotCarried
    from comfyui_hybrid_parallel.workers.bridge.carry import call_options, rebuild_options

    def skip(args, extra_args):  # Skip Layer Guidance's
        return args

    def perturbed_attention(q, k, v, extra_options, mask=None):  # PAG's
        return v
    scale = 0.5

    def scaled(args, extra_args):  # looks alike, computes something else: refused
        return args * scale
    sent = call_options({"patches_replace": {"dit": {("double_block", 3): skip},
                                             "attn1": {("middle", 0): perturbed_attention}}})
    assert sent == {"patches_replace": {"dit": [["double_block", 3, "skip"]], "attn1": [["middle", 0, "value"]]}}
    rebuilt = rebuild_options(sent)["patches_replace"]
    x = torch.randn(2)
    assert rebuilt["dit"][("double_block", 3)](x, {}) is x
    assert rebuilt["attn1"][("middle", 0)](1, 2, x, {}) is x
    with pytest.raises(NotCarried, match="replaces the 'dit' block"):
        call_options({"patches_replace": {"dit": {("double_block", 3): scaled}}})


def test_the_residency_key_follows_the_patches_not_comfyuis_uuid(patcher):
    from comfyui_hybrid_parallel.workers.bridge.residency import weights_key
    lora = {"diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": (torch.randn(96, 32) * 0.01,)}
    a, b = patcher.clone(), patcher.clone()
    a.add_patches(lora, 0.5)
    b.add_patches(lora, 0.5)
    b.patches_uuid = a.patches_uuid = None  # uuids say nothing
    assert weights_key(a.model, a.patches) == weights_key(b.model, b.patches)
    c = patcher.clone()
    c.add_patches(lora, 0.7)
    c.patches_uuid = a.patches_uuid
    assert weights_key(c.model, c.patches) != weights_key(a.model, a.patches)
    assert weights_key(patcher.model, {}) != weights_key(a.model, a.patches)
    assert weights_key(a.model, a.patches, "cast-bfloat16") != weights_key(a.model, a.patches)


def test_origins_are_named_whatever_folder_a_pack_is_in():
    from comfyui_hybrid_parallel.workers.bridge.origin import module_name
    assert module_name("/srv/ComfyUI/comfy_extras/nodes_slg") == "comfy_extras.nodes_slg"
    assert module_name("comfy_extras.nodes_slg") == "comfy_extras.nodes_slg"
    for folder in ("ComfyUI-KJNodes", "comfyui-kjnodes", "ComfyUI_KJNodes"):
        assert module_name(f"/srv/ComfyUI/custom_nodes/{folder}.nodes.nodes") == "custom_nodes.kjnodes.nodes.nodes"


def test_freeu_travels_as_comfyuis_own_function_around_its_numbers(tmp_path):
    """FreeU's output-block patch: its closure's numbers travel, the rank rebuilds ComfyUI's own function from its
    module - the same output on the same activations."""
    setup_comfy()
    import comfy.sd
    from comfy_extras.nodes_freelunch import FreeU_V2

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.workers.bridge.carry import closure_of, rebuild_closure
    tc.write_unet(tmp_path / "tiny_sd15.safetensors", xl=False, seed=41, dtype=torch.float32)
    unet = comfy.sd.load_diffusion_model(str(tmp_path / "tiny_sd15.safetensors"))
    patched = FreeU_V2.execute(unet, 1.3, 1.4, 0.9, 0.2)[0]
    fn = patched.model_options["transformer_options"]["patches"]["output_block_patch"][0]
    import json
    spec = json.loads(json.dumps(closure_of(fn)))  # what travels is JSON
    again = rebuild_closure(spec)
    assert again is not fn and again.__code__ is fn.__code__
    channels = unet.model.model_config.unet_config["model_channels"] * 4
    g = torch.Generator().manual_seed(0)
    h, hsp = torch.randn(2, channels, 8, 8, generator=g), torch.randn(2, channels, 8, 8, generator=g)
    a, b = fn(h.clone(), hsp.clone(), {}), again(h.clone(), hsp.clone(), {})
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
