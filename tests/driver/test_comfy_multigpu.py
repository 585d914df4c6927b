"""Beside ComfyUI's own multi-GPU nodes (ComfyUI >= 0.23): MultiGPU CFG Split (MultiGPU_WorkUnits) gives the MODEL
whole-model copies on the machine's other GPUs and runs the cond / uncond batches on them in threads.

Where it has something to split (other devices), it and the pack's Parallel Model / Hybrid Sampler would both split
the same model calls - refused before any work, in either order, saying which to keep. Where it has nothing to
split (one device, as on this CPU: ComfyUI's node logs "No extra torch devices" and returns a plain clone), the
graph with both nodes runs and equals KSampler. The copies ComfyUI makes on other GPUs are stood in for by a clone
registered under "multigpu", as comfy.multigpu.create_multigpu_deepclones registers its deep clones.
"""
from __future__ import annotations

import pytest
import torch

from test_dynamic_vram import _hp, _hybrid, _ksampler, _model, ckpt, runtime  # noqa: F401

pytestmark = pytest.mark.comfy


def _multigpu_node():
    import comfy.model_patcher as mp
    if not hasattr(mp.ModelPatcher, "deepclone_multigpu"):
        pytest.skip("this ComfyUI (< 0.23) has no MultiGPU CFG Split")
    from comfy_extras.nodes_multigpu import MultiGPUCFGSplitNode
    return MultiGPUCFGSplitNode


def _split(model):
    """The MODEL as MultiGPU CFG Split returns it on a machine with a second GPU: a copy registered under
    "multigpu" (a clone here: this machine has one device)."""
    out = model.clone()
    out.set_additional_models("multigpu", [model.clone()])
    return out


def test_multigpu_cfg_split_with_nothing_to_split_runs_beside_parallel_model(ckpt, runtime):  # noqa: F811
    node = _multigpu_node()
    from comfyui_hybrid_parallel.nodes.model_node import ParallelModel
    ref = _ksampler(_model(ckpt, False))
    theirs = node.execute(_model(ckpt, False), 2)[0]  # one device: ComfyUI adds no copy
    assert not theirs.get_additional_models_with_key("multigpu")
    (ours,) = ParallelModel().patch(theirs, _hp(ulysses_degree=2))
    got = _ksampler(ours)
    assert (got - ref).abs().max() / ref.abs().max() <= 1e-5


def test_a_model_split_by_multigpu_cfg_split_is_refused_before_any_work(ckpt, runtime):  # noqa: F811
    _multigpu_node()
    from comfyui_hybrid_parallel.nodes.model_node import ParallelModel
    worlds = len(runtime._pool.health()) if runtime._pool is not None else 0
    # theirs, then ours
    with pytest.raises(ValueError, match="MultiGPU CFG Split.*Use one of the two"):
        ParallelModel().patch(_split(_model(ckpt, False)), _hp(ulysses_degree=2))
    with pytest.raises(ValueError, match="MultiGPU CFG Split.*Use one of the two"):
        _hybrid(_split(_model(ckpt, False)), _hp(ulysses_degree=2))
    # ours, then theirs: refused when the sampler starts, before the first model call
    (ours,) = ParallelModel().patch(_model(ckpt, False), _hp(ulysses_degree=2))
    with pytest.raises(ValueError, match="MultiGPU CFG Split.*remove Parallel Model"):
        _ksampler(_split(ours))
    assert (len(runtime._pool.health()) if runtime._pool is not None else 0) == worlds  # no world started for it
