"""A model changed in place - outside ModelPatcher - is refused before any work, naming the node
(workers/bridge/inplace.py), in Parallel Model, Hybrid Sampler and the workers' own loop.

The changes are made by the tests' stand-in node (tests/standins/hp_inplace_nodes: the mechanisms of ComfyUI-PuLID-Flux,
BrushNet and packs that patch ComfyUI's classes) on the tiny SD3 the server holds, and put back at the end of each
test. Each one changes what KSampler computes (the comparison with the plain graph shows it), so a pool that ran
without it would be silently different - the refusal is what keeps the picture right. BrushNet's sampling-function
replacement runs in ComfyUI's process in step mode (exact: it equals KSampler with the node) and is refused in the
workers' own loop; its replacement of the UNet's apply_control is refused on the UNet in every mode.
"""
import pytest

from comfy_server import assert_ok, latent, rel
from test_every_graph import _equal, _family, _graph, _refused

pytestmark = pytest.mark.comfy

NODE = "HPTestInPlacePatch (node 20)"


def _patch(what):
    return {"20": {"class_type": "HPTestInPlacePatch", "inputs": {"what": what}}}


@pytest.fixture
def restored(server):
    """Puts ComfyUI's model and code back after the test, whatever it left patched."""
    yield
    assert_ok(server, server.run(_graph("inplace_restore", model_nodes=_patch("restore"))))


def _changes_ksampler(server, what, family="sd3"):
    """KSampler with the node differs from KSampler without it (the stand-in put back first: a module-wide change
    outlives its prompt, as the real packs' do): the node acts."""
    assert_ok(server, server.run(_graph(f"inplace_plain_{family}", model_nodes=_patch("restore"), family=family)))
    assert_ok(server, server.run(_graph(f"inplace_{what}_{family}", model_nodes=_patch(what), family=family)))
    effect = rel(latent(server, f"inplace_{what}_{family}"), latent(server, f"inplace_plain_{family}"))
    print(f"{what} changes KSampler's latent by {effect:.2e}")
    assert effect > 1e-4, effect


@pytest.mark.parametrize("what", ["instance_method", "class_method"])
def test_a_method_replaced_on_the_model_or_its_class_is_refused(server, restored, what):
    """PuLID-Flux's mechanism (the core method replaced on the diffusion model instance) and a method replaced on
    ComfyUI's class: refused in Parallel Model, Hybrid Sampler and the workers' loop, naming the node."""
    _changes_ksampler(server, what)
    for tag, degrees, node, node_type in (("pm", {"cfg_degree": 2}, "model", "HybridParallelModel"),
                                          ("hs", {"ulysses_degree": 2}, "sampler", "HybridSampler"),
                                          ("loop", {"ulysses_degree": 2, "sampling_mode": "loop"}, "sampler",
                                           "HybridSampler")):
        _refused(server, _graph(f"inplace_{what}_{tag}", degrees, node, model_nodes=_patch(what)),
                 NODE, "outside ModelPatcher", "replaced", node_type=node_type)


def test_a_module_added_to_the_model_is_refused(server, restored):
    """PuLID-Flux adds its attention modules to the diffusion model (`pulid_ca`): weights the workers' model, built
    from ComfyUI's class, does not have - a refusal, not a silently dropped key."""
    msg = _refused(server, _graph("inplace_added", {"ulysses_degree": 2}, "model", model_nodes=_patch("added_module")),
                   NODE, "a module 'hp_extra_ca'", "adds modules or weights")
    assert "ExtraCrossAttention" in msg, msg


def test_brushnet_sampling_runs_in_step_mode_and_is_refused_in_the_loop(server, restored):
    """BrushNet replaces comfy.samplers.sample (a pass-through here) and the UNet's apply_control module-wide: on SD3
    (no UNet code runs) step mode equals KSampler with the node; the workers' own loop, which stands in for ComfyUI's
    sampling, refuses it; on the UNet its apply_control is the model's own code - refused."""
    _equal(server, "inplace_brushnet", [("pm_u2", {"ulysses_degree": 2}, "model")], model_nodes=_patch("brushnet"))
    _refused(server, _graph("inplace_brushnet_loop", {"ulysses_degree": 2, "sampling_mode": "loop"}, "sampler",
                            model_nodes=_patch("brushnet")),
             NODE, "comfy.samplers.sample", "sampling_mode to step", node_type="HybridSampler")
    _family(server, "sd15")
    _changes_ksampler(server, "brushnet", family="sd15")
    _refused(server, _graph("inplace_brushnet_unet", {"cfg_degree": 2}, "model", model_nodes=_patch("brushnet"),
                            family="sd15"),
             NODE, "apply_control", node_type="HybridParallelModel")
