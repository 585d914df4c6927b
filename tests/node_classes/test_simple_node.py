"""Parallel GPUs (the simple node), the nodes' names and categories, and the CFG-idle warning - node logic only,
no workers. The node end to end in a real ComfyUI: tests/server_e2e/test_comfyui_parallel_model.py."""
import logging
import types

import pytest
import torch

from comfyui_hybrid_parallel.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from comfyui_hybrid_parallel.workers.driver.auto import warn_idle_cfg
from comfyui_hybrid_parallel.workers.bridge.prepare import guider_inputs
from comfyui_hybrid_parallel.workers.driver.configs import PRESETS, HybridParallelConfig, auto_device_count
from comfyui_hybrid_parallel.nodes.simple_node import ParallelGPUsNode
from comfyui_hybrid_parallel.parallel import ParallelConfig

configure = ParallelGPUsNode.configure


def test_two_widgets_only_and_every_preset_builds_the_config_it_names():
    inputs = ParallelGPUsNode.INPUT_TYPES()
    assert list(inputs["required"]) == ["devices", "preset"] and "optional" not in inputs
    assert inputs["required"]["preset"][1]["default"] == "auto" and inputs["required"]["devices"][1]["default"] == "all"
    hp = configure("cpu,cpu", "auto")
    assert hp.auto_devices == 2 and hp.device_list == ("cpu", "cpu") and hp.config.world_size == 1
    hp = configure("cpu,cpu,cpu", "split the image")
    assert (hp.config.ulysses_degree, hp.config.world_size, hp.config.devices) == (3, 3, ("cpu",) * 3)
    hp = configure("cpu,cpu,cpu,cpu", "cfg + split the image")
    assert (hp.config.cfg_degree, hp.config.ulysses_degree) == (2, 2)
    hp = configure("cpu,cpu", "large model (shard weights)")
    assert (hp.config.ulysses_degree, hp.config.shard_weights) == (2, "sequence")
    assert hp.mode == "auto" and hp.attention == "auto" and hp.device == "auto" and hp.cluster is None
    assert set(PRESETS) == {"auto", "split the image", "cfg + split the image", "large model (shard weights)"}


def test_device_counts_and_lists():
    n = auto_device_count("auto")
    assert configure("all", "auto").auto_devices == n
    assert configure("1", "auto").auto_devices == 1  # auto chooses among the first N only
    hp = configure("1", "split the image")
    assert hp.config.world_size == 1 and hp.config.devices == ()
    assert configure(" CPU , cpu ", "split the image").config.devices == ("cpu", "cpu")


@pytest.mark.parametrize("devices, preset, match", [
    ("cpu,cpu,cpu", "cfg + split the image", "needs an even number of devices"),
    ("999", "auto", "available here; give a number from 1"),
    ("0", "auto", "available here"),
    ("cpu:0", "auto", "neither cpu nor cuda"),
    ("cuda:0,cuda:0", "split the image", "Parallel GPUs:"),
    ("cpu,cuda:0", "split the image", "Parallel GPUs:"),
    ("all", "fastest", "preset must be one of"),
])
def test_bad_input_names_the_fix_and_the_node(devices, preset, match):
    with pytest.raises(ValueError, match=match) as e:
        configure(devices, preset)
    assert str(e.value).startswith("Parallel GPUs:"), e.value


def test_auto_with_a_listed_device_this_machine_lacks_is_refused_before_anything_starts(monkeypatch):
    """degrees auto chooses the world later, at the sampler; the devices it may use are checked now."""
    monkeypatch.setattr(ParallelGPUsNode, "runtime", None)
    with pytest.raises(ValueError, match=r"^Parallel GPUs: device 'cuda:6' does not exist here"):
        ParallelGPUsNode().build("cuda:6,cuda:7", "auto")


def test_one_category_and_display_names_that_say_what_each_node_is():
    from comfy_env import setup_comfy
    setup_comfy()  # Hybrid Sampler's inputs list ComfyUI's samplers
    assert set(NODE_CLASS_MAPPINGS) == {"HybridParallelGPUs", "HybridParallelConfig", "HybridSampler",
                                        "HybridPatchVAEDecode", "HybridParallelCluster", "HybridParallelModel"}
    for key, cls in NODE_CLASS_MAPPINGS.items():
        assert cls.CATEGORY.split("/")[0] == "Hybrid Parallel", (key, cls.CATEGORY)
        assert cls.DESCRIPTION and key in NODE_DISPLAY_NAME_MAPPINGS
    assert NODE_CLASS_MAPPINGS["HybridParallelConfig"].CATEGORY == "Hybrid Parallel/advanced"
    assert "patch" not in " ".join(NODE_DISPLAY_NAME_MAPPINGS.values()).lower()  # "patch" is model patching here
    for cls in NODE_CLASS_MAPPINGS.values():  # every widget says when to use it
        spec = cls.INPUT_TYPES()
        for name, value in {**spec["required"], **spec.get("optional", {})}.items():
            assert len(value) > 1 and value[1].get("tooltip"), (cls.__name__, name)


def test_cfg_degree_with_cfg_1_warns_and_names_the_fix(caplog):
    hp = HybridParallelConfig(ParallelConfig(cfg_degree=2, ulysses_degree=2))
    neg = [[torch.zeros(1, 4, 8), {}]]
    with caplog.at_level(logging.WARNING, logger="comfyui_hybrid_parallel.auto"):
        assert warn_idle_cfg(hp, 1.0, neg, "Hybrid Sampler")
        assert warn_idle_cfg(hp, 4.0, None, "Parallel Model")  # no negative: no unconditional pass either
        assert not warn_idle_cfg(hp, 4.0, neg, "Hybrid Sampler")
        assert not warn_idle_cfg(HybridParallelConfig(ParallelConfig(ulysses_degree=2)), 1.0, neg, "x")
    text = caplog.text
    assert text.count("repeat the same work") == 2 and "set cfg_degree to 1" in text


def test_guider_inputs_read_what_auto_needs_from_comfys_guiders():
    """What Parallel Model's run sees: a CFGGuider (cfg, positive/negative as ComfyUI's converted dicts), a
    DualCFGGuider (cfg1/cfg2) and a BasicGuider (no negative)."""
    lat = torch.zeros(2, 16, 9, 13)
    pos = [{"cross_attn": torch.zeros(1, 7, 32), "model_conds": {}}]
    neg = [{"cross_attn": torch.zeros(1, 11, 32), "model_conds": {}}]
    cfg = types.SimpleNamespace(cfg=4.5, conds={"positive": pos, "negative": neg})
    shape, scale, negative, positive = guider_inputs(cfg, (None, lat, None, None), {})
    assert shape == (2, 16, 9, 13) and scale == 4.5 and negative[0][0].shape[1] == 11 and positive[0][0].shape[1] == 7
    dual = types.SimpleNamespace(cfg=1.0, cfg1=1.0, cfg2=2.0, conds={"positive": pos, "negative": neg})
    assert guider_inputs(dual, (), {"latent_image": lat})[1] == 2.0
    basic = types.SimpleNamespace(cfg=1.0, conds={"positive": pos})
    assert guider_inputs(basic, (None, lat), {})[1:3] == (1.0, None)


def test_the_config_nodes_say_what_this_system_cannot_run_before_anything_starts(monkeypatch):
    """Windows (no worker pool) and macOS with device cuda: Parallel GPUs and Parallel Config refuse at once with the
    fix (workers/platform_support.py decides; simulated here), and nothing is started."""
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    from comfyui_hybrid_parallel.workers import platform_support as ps

    class Runtime:
        def prestart(self, hp):
            raise AssertionError("started workers")
    monkeypatch.setattr(ParallelGPUsNode, "runtime", Runtime())
    monkeypatch.setattr(ParallelConfigNode, "runtime", Runtime())
    widgets = dict(dp_degree=1, cfg_degree=1, ulysses_degree=2, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
                   warmup_steps=1, tp_degree=1, method="usp", attention="auto")
    monkeypatch.setattr(ps, "_system", lambda: "win32")
    with pytest.raises(ValueError, match=r"^Parallel GPUs: .*WSL2"):
        ParallelGPUsNode().build("cpu,cpu", "split the image")
    with pytest.raises(ValueError, match=r"^Parallel Config: .*WSL2"):
        ParallelConfigNode().build(device="cpu", **widgets)
    monkeypatch.setattr(ps, "_system", lambda: "darwin")
    monkeypatch.setattr(ps, "_torch_facts", lambda: dict(distributed=True, gloo=True, nccl=False, cuda=False,
                                                         mps=True))
    with pytest.raises(ValueError, match="no CUDA device.*use device 'cpu' or 'auto'"):  # the devices' own message
        ParallelConfigNode().build(device="cuda", **widgets)
    monkeypatch.setattr(ParallelGPUsNode, "runtime", None)  # CPU ranks do run on macOS: nothing refused
    assert ParallelGPUsNode().build("cpu,cpu", "split the image")["result"][0].config.ulysses_degree == 2


# each template's split on a 4-GPU machine (what its name and its Note say): (cfg, ulysses, shard_weights)
TEMPLATE_SPLITS = {
    "flux1_dev_fp8_2gpu_ulysses2": (1, 2, "none"), "flux1_dev_fp8_4gpu_ulysses4": (1, 4, "none"),
    "sd35_large_fp8_cfg2_ulysses2": (2, 2, "none"), "qwen_image_shard_weights": (1, 4, "sequence"),
    "wan22_i2v_14b_two_experts_24gb": (1, 4, "sequence"), "wan22_ti2v_5b_cfg2_ulysses2": (2, 2, "none"),
    "hunyuan_video15_720p_t2v_shard_weights": (1, 4, "sequence"), "flux1_kontext_dev_edit_ulysses2": (1, 2, "none"),
    "z_image_cfg2_2gpu": (2, 1, "none"), "ltx23_t2v_audio_ulysses4": (1, 4, "none"),
    "minimax_h3_t2v_audio_ulysses4": (1, 4, "none"),
}


def test_every_template_is_on_the_simple_path_and_splits_as_its_name_says(monkeypatch):
    """The templates (examples/make_templates.py) use Parallel GPUs -> Parallel Model in front of ComfyUI's own
    samplers, as README starts a user; on a 4-GPU machine each one's Parallel GPUs builds the split its name and
    Note say. (Each runs as an API prompt against its plain twin: tests/server_e2e/test_comfyui_workflow_templates.)"""
    import sys
    from pathlib import Path
    from comfyui_hybrid_parallel.workers.driver import configs
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import make_templates
    monkeypatch.setattr(configs, "auto_device_count", lambda device: 4)
    templates = make_templates.templates()
    assert sorted(templates) == sorted(TEMPLATE_SPLITS)
    for name, (g, note, _) in templates.items():
        classes = [n["class_type"] for n in g.values()]
        assert "HybridParallelConfig" not in classes and "HybridSampler" not in classes, name
        gpus = [n["inputs"] for n in g.values() if n["class_type"] == "HybridParallelGPUs"]
        models = [n for n in g.values() if n["class_type"] == "HybridParallelModel"]
        assert len(gpus) == 1 and models, name
        for m in models:  # every Parallel Model feeds a sampler or guider of ComfyUI's own
            assert g[m["inputs"]["parallel_config"][0]]["class_type"] == "HybridParallelGPUs", name
        hp = configure(gpus[0]["devices"], gpus[0]["preset"])
        got = (hp.config.cfg_degree, hp.config.ulysses_degree, hp.config.shard_weights)
        assert got == TEMPLATE_SPLITS[name], (name, got)
        assert gpus[0]["preset"] in note and "Parallel GPUs" in note, name


def test_the_shared_configure_defaults_are_the_config_nodes_widget_defaults():
    """The routes (mesh picture, headless warm-up, HP_PRESTART) fill a missing widget from configs.configure's
    defaults; the node fills it from its widgets. A widget whose default changes in one place only would make the
    picture draw another world than the prompt runs."""
    import inspect
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    from comfyui_hybrid_parallel.workers.driver import configs
    widgets = {}
    for section in ParallelConfigNode.INPUT_TYPES().values():
        for name, (kind, *opts) in section.items():
            if isinstance(kind, str) and kind.isupper() and kind not in ("INT", "STRING", "FLOAT", "BOOLEAN"):
                continue  # a link (the cluster), not a widget
            widgets[name] = (opts[0] if opts else {}).get("default", kind[0] if isinstance(kind, list) else None)
    shared = {n: p.default for n, p in inspect.signature(configs.configure).parameters.items() if n != "cluster"}
    assert widgets == shared
    assert ParallelConfigNode.configure is configs.configure and ParallelGPUsNode.configure is configs.configure_gpus
