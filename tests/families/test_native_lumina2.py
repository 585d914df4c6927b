"""Lumina 2 and Z-Image on the workers (ComfyUI's NextDiT), against ComfyUI's own forward.

NextDiT refines the caption and the image apart, then runs one [caption, image] stream; the plan splits the image
tokens at the first noise-refiner block and gathers [caption, image] behind one caption copy at the final layer.
ComfyUI's detection maps only two widths: Lumina 2 (2304, 24 heads x 96 with 8 KV heads: 0.42B parameters with one
main layer) and Z-Image (3840, 30 heads x 128, image and caption padded to multiples of 32: 0.90B). Fresh random
inputs, odd and even latents (odd: ComfyUI pads to the patch grid, Z-Image then pads the tokens), ulysses 2,
ring 2, ulysses 2 x ring 2 and cfg 2; Z-Image is `slow` (run before resolving). Where `unpatchify` cuts the image
out is ComfyUI's caption length, which ComfyUI 0.33 computes from the split stream: the plan resets it (the odd
latents catch a wrong cut). Reference latents (ComfyUI 0.33's Omni / edit mode) equal ComfyUI's forward under
ulysses, ring and cfg.
"""
import pytest
import torch

from test_native_pool import comfy, comfy_forward, rel  # noqa: F401
from test_native_refs import _send  # what the nodes send for a call with reference lists

pytestmark = pytest.mark.comfy

CASES = ({"ulysses_degree": 2}, {"ring_degree": 2}, {"ulysses_degree": 2, "ring_degree": 2}, {"cfg_degree": 2})


def _pool_forward(pool, config, key, base, inp):
    """pool_forward with NextDiT's plain-int `num_tokens` in the JSON part of the call, as the nodes send it."""
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
    dm = base.diffusion_model
    pool.ensure_model(config, key, family_adapter(dm).family, native=native_spec(base),
                      state_dict=lambda: dict(dm.state_dict()))
    tensors = {k: v for k, v in inp.items() if isinstance(v, torch.Tensor)}
    structure = {"transformer_options": {}, **{k: v for k, v in inp.items() if k not in tensors}}
    return pool.submit(config, "forward", {"key": key, "structure": structure}, tensors).tensors["out"]


def _check(cpu_pool, tmp_path, z_image: bool, cases, sizes, dtype=torch.float8_e4m3fn):
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    name = "zimage" if z_image else "lumina2"
    path = tmp_path / f"{name}.safetensors"
    tiny.write_lumina2(path, z_image=z_image, seed=71 + z_image)
    base = load_diffusion_model(str(path), model_options={} if dtype is None else {"dtype": dtype}).model
    dm = base.diffusion_model
    assert type(dm).__name__ == "NextDiT" and family_adapter(dm).family == "lumina2"
    assert (dm.pad_tokens_multiple is not None) == z_image
    dtype = base.manual_cast_dtype or dm.dtype
    for degrees in cases:
        config = ParallelConfig(**degrees)
        for h, w in sizes:
            g = torch.Generator().manual_seed(72 + h)
            inp = {"x": torch.randn(2, 16, h, w, generator=g).to(dtype),
                   "context": torch.randn(2, 5, 32, generator=g).to(dtype),
                   "num_tokens": 5, "timestep": torch.rand(2, generator=g)}
            ref = comfy_forward(base, inp)
            out = _pool_forward(cpu_pool, config, f"{name}:{config.describe()}", base, inp)
            err = rel(out, ref)
            print(f"{name} {config.describe()} {h}x{w}: rel {err:.2e}")
            assert out.shape == ref.shape and err <= 1e-5, (degrees, h, w, err)


def test_lumina2_equals_comfyui(comfy, cpu_pool, tmp_path):  # noqa: F811
    """ulysses 2 x ring 2 (both splits at once) here, in fp32 (fp8 casts all 0.42B weights at every call on a CPU,
    on every rank: twice the test's time); every degree, in fp8, in the real-ComfyUI test and the slow one."""
    _check(cpu_pool, tmp_path, False, CASES[2:3], [(9, 13), (8, 12)], dtype=None)


@pytest.mark.slow
def test_lumina2_every_degree_equals_comfyui(comfy, cpu_pool, tmp_path):  # noqa: F811
    _check(cpu_pool, tmp_path, False, CASES, [(9, 13), (8, 12)])


@pytest.mark.slow
def test_z_image_equals_comfyui(comfy, cpu_pool, tmp_path):  # noqa: F811
    _check(cpu_pool, tmp_path, True, CASES, [(9, 13), (8, 16)])


@pytest.mark.slow
def test_lumina2_distrifusion_and_sharded_weights(comfy, cpu_pool, tmp_path):  # noqa: F811
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from test_native_hunyuan_video import distrifusion_and_sharded
    path = tmp_path / "lumina2.safetensors"
    tiny.write_lumina2(path, seed=75)
    base = load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn}).model
    g = torch.Generator().manual_seed(76)
    inp = {"x": torch.randn(2, 16, 9, 13, generator=g), "context": torch.randn(2, 5, 32, generator=g),
           "num_tokens": 5, "timestep": torch.rand(2, generator=g)}
    errs = distrifusion_and_sharded(cpu_pool, "lumina2", base, inp, _pool_forward, comfy_forward(base, inp))
    print(f"Lumina 2: {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs




@pytest.mark.parametrize("more", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_lumina2_reference_latents(comfy, cpu_pool, tmp_path, more):  # noqa: F811
    """Omni / edit mode (ComfyUI 0.33: `ref_latents`, one caption per reference in `ref_contexts`) joins the
    references' tokens to the image sequence and marks token ranges (`timestep_zero_index`) over the image sequence
    and over the joined stream: under ulysses 2, ring 2 and ulysses 2 x ring 2 each rank's ranges are cut to its own
    tokens (refused before; a split taking ComfyUI's ranges as they are was 5.3e-2 wrong; ring and u2 x r2 on two
    references, whose tokens do not divide), and under cfg 2 - each sample
    its own references, the lists split with the batch - all equal to ComfyUI's forward, on references of two sizes
    (one whose tokens do not divide). A ComfyUI whose NextDiT takes no references ignores them."""
    import inspect

    from comfy.ldm.lumina.model import NextDiT
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    path = tmp_path / "lumina2.safetensors"
    tiny.write_lumina2(path, seed=77)
    # CI in fp32 (fp8 casts all weights at every call on a CPU); the slow set in fp8 as most people run it
    base = load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn} if more else {}).model
    dtype = base.manual_cast_dtype or base.diffusion_model.dtype
    g = torch.Generator().manual_seed(78)
    plain = {"x": torch.randn(2, 16, 9, 13, generator=g).to(dtype),
             "context": torch.randn(2, 5, 32, generator=g).to(dtype), "num_tokens": 5,
             "timestep": torch.rand(2, generator=g)}
    refs = {"one": dict(plain, ref_latents=[torch.randn(2, 16, 6, 10, generator=g).to(dtype)],
                        ref_contexts=[torch.randn(2, 4, 32, generator=g).to(dtype)]),
            "two": dict(plain, ref_latents=[torch.randn(2, 16, 6, 10, generator=g).to(dtype),
                                            torch.randn(2, 16, 6, 6, generator=g).to(dtype)],
                        ref_contexts=[torch.randn(2, 4, 32, generator=g).to(dtype),
                                      torch.randn(2, 3, 32, generator=g).to(dtype)])}
    takes_refs = "ref_latents" in inspect.signature(NextDiT._forward).parameters
    want = {}
    for name, inp in refs.items():
        want[name] = comfy_forward(base, inp)
        if takes_refs:
            assert rel(comfy_forward(base, plain), want[name]) > 1e-3  # the references matter
    # CI: one reference under u2 and cfg 2, two (tokens that do not divide) under u2; the slow set: ring 2 and
    # u2 x r2 on the two
    meshes = {"one": () if more else ({"ulysses_degree": 2}, {"cfg_degree": 2}),
              "two": ({"ring_degree": 2}, {"ulysses_degree": 2, "ring_degree": 2}) if more else
                     ({"ulysses_degree": 2},)}
    runs = [(name, degrees) for name in refs for degrees in meshes[name]]
    # cfg 2 last: the sequence cases share one world, cfg's is another (one world switch, not two)
    for name, degrees in sorted(runs, key=lambda run: "cfg_degree" in run[1]):
        config = ParallelConfig(**degrees)
        ref = want[name]
        out = _send(cpu_pool, config, f"lumina2:{config.describe()}", base, refs[name])
        err = rel(out, ref)
        print(f"Lumina 2 references ({name}) {config.describe()}: rel {err:.2e}")
        assert out.shape == ref.shape and err <= 1e-5, (name, degrees, err)
