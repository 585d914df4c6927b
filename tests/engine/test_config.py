"""ParallelConfig validation: every refusal names what to change."""
import pytest

from comfyui_hybrid_parallel.parallel import ConfigError, ParallelConfig


def test_defaults_are_serial():
    c = ParallelConfig()
    assert c.world_size == 1 and c.sp_degree == 1 and c.num_pipeline_patch == 1
    assert c.describe() == "serial"


def test_derived_sizes():
    c = ParallelConfig(dp_degree=2, cfg_degree=2, ulysses_degree=2, ring_degree=3, pp_degree=2, num_pipeline_patch=4)
    assert c.sp_degree == 6
    assert c.world_size == 2 * 2 * 6 * 2
    assert c.describe() == "dp2·cfg2·pp2·ring3·ulysses2"


@pytest.mark.parametrize("kwargs, words", [
    (dict(dp_degree=0), ["dp_degree", ">= 1"]),
    (dict(ulysses_degree=-1), ["ulysses_degree", ">= 1"]),
    (dict(ring_degree=1.5), ["ring_degree", "integer"]),
    (dict(tp_degree=True), ["tp_degree", "integer"]),
    (dict(cfg_degree=3), ["cfg_degree", "1 or 2", "dp_degree"]),
    (dict(warmup_steps=-1), ["warmup_steps", ">= 0"]),
    (dict(pp_degree=4, num_pipeline_patch=2), ["num_pipeline_patch (2)", "pp_degree (4)", "4 or more"]),
    (dict(num_pipeline_patch=3), ["num_pipeline_patch=3", "pp_degree > 1"]),
    (dict(pp_degree=2, attn_layer_num_for_pp=[3]), ["attn_layer_num_for_pp has 1", "pp_degree is 2"]),
    (dict(pp_degree=2, attn_layer_num_for_pp=[3, 0]), ["attn_layer_num_for_pp[1]", ">= 1"]),
    (dict(tp_degree=2, pp_degree=2), ["tp_degree", "pp_degree", "not supported"]),
    (dict(method="distrifusion", ring_degree=2), ["distrifusion", "ring_degree=1"]),
    (dict(method="pipefusion"), ["method", "usp"]),
    (dict(ulysses_degree=2, cfg_degree=2, devices=["cuda:0", "cuda:1"]), ["world of 4", "2 device(s)", "list 4"]),
])
def test_refusals_name_what_to_change(kwargs, words):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_valid_pipefusion_and_devices():
    c = ParallelConfig(pp_degree=2, attn_layer_num_for_pp=[1, 3], devices=["cuda:0", "cuda:1"])
    assert c.attn_layer_num_for_pp == (1, 3) and c.num_pipeline_patch == 2 and c.devices == ("cuda:0", "cuda:1")


def test_check_world():
    c = ParallelConfig(dp_degree=2, ulysses_degree=4)
    c.check_world(8)
    with pytest.raises(ConfigError, match="need 8 devices but only 4"):
        c.check_world(4)


def test_roundtrip_and_mesh_key():
    c = ParallelConfig(cfg_degree=2, pp_degree=2, num_pipeline_patch=3, attn_layer_num_for_pp=(2, 2), warmup_steps=3)
    d = c.to_dict()
    d["attn_layer_num_for_pp"] = list(d["attn_layer_num_for_pp"])
    assert ParallelConfig.from_dict(d) == c
    assert c.mesh_key() == ParallelConfig(cfg_degree=2, pp_degree=2, warmup_steps=0).mesh_key()
    assert c.mesh_key() != ParallelConfig(cfg_degree=2, ulysses_degree=2).mesh_key()
    with pytest.raises(ConfigError, match="unknown"):
        ParallelConfig.from_dict({"sp_degree": 2})


def test_frozen():
    c = ParallelConfig()
    with pytest.raises(Exception):
        c.dp_degree = 2


@pytest.mark.parametrize("devices, words", [
    (["cuda:0", "cuda:0"], ["cuda:0 more than once", "one rank per GPU"]),
    (["cpu", "cuda:1"], ["mix CPU and CUDA", "only cuda:<index> devices or only cpu"]),
    (["cuda", "cuda:1"], ["names no GPU", "cuda:0,cuda:1"]),
    (["tpu:0", "cpu"], ["neither cpu nor cuda"]),
    (["cuda:x", "cuda:1"], ["names no GPU"]),
])
def test_device_lists_one_world_cannot_run_are_refused(devices, words):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(ulysses_degree=2, devices=devices)
    for w in words:
        assert w in str(e.value)


def test_device_lists_are_normalised_and_cpu_ranks_may_share():
    assert ParallelConfig(ulysses_degree=2, devices=[" CUDA:01", "cuda:0 "]).devices == ("cuda:1", "cuda:0")
    assert ParallelConfig(ulysses_degree=2, devices=["cpu", "CPU"]).devices == ("cpu", "cpu")
