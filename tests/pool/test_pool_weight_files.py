"""Weight files written ahead of their load survive a world restart that runs meanwhile.

ensure_model writes a model's weights into shared-memory files *before* it takes the pool (so the copy overlaps a
world that Parallel Config's prestart may still be starting), naming each file in the pool's `_written` before
creating it; a world torn down meanwhile (the prestart of the next prompt's mesh: cfg 2 -> ulysses 2 is another
world where ComfyUI's attention kernel is not pytorch's) removes the pool's files but those. It used to take that
set before listing the directory, so a file named and created in between - while the other thread wrote - was
removed, and the load that followed failed on a rank with "unable to open file </dev/shm/chp-...> in read-only mode"
(Wan I2V / VACE under ulysses 2 after earlier prompts of another mesh on the same ComfyUI server). Now the set is
asked after the listing.

The race is made certain here, not hoped for: the adopt callback (called after each weight is written) starts the
world change on another thread, as the prestart does, and holds the writers until that teardown lists the directory;
the listing then waits until a file named after the teardown took its look exists. Three prompts' worth of models
on one pool (max_models 2): model A under cfg 2, model B under ulysses 2 (the race), model A again.
"""
import threading

import pytest
import torch

from test_native_pool import comfy, comfy_forward, rel  # noqa: F401

pytestmark = pytest.mark.comfy


def _base(comfy_dir, name, seed):
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = comfy_dir / f"{name}.safetensors"
    tiny.write_wan(path, dim=256, ffn_dim=256, seed=seed)
    return load_diffusion_model(str(path)).model


def _load(pool, config, key, base, adopt=None):
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, host_tensors, native_spec
    from comfyui_hybrid_parallel.workers.bridge.loader_types import raw
    dm = base.diffusion_model
    return pool.ensure_model(config, key, family_adapter(dm).family, native=native_spec(base), adopt=adopt,
                             state_dict=lambda: {k: raw(v) for k, v in host_tensors(dm).items()})


def _forward(pool, config, key, inp):
    return pool.submit(config, "forward", {"key": key, "structure": {"transformer_options": {}}},
                       dict(inp)).tensors["out"]


def test_weights_written_during_a_world_restart_are_kept(comfy, monkeypatch):  # noqa: F811
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers import transport
    from comfyui_hybrid_parallel.workers.pool import WorkerPool

    a, b = _base(comfy, "wan_a", 31), _base(comfy, "wan_b", 32)
    g = torch.Generator().manual_seed(33)
    inp = {"x": torch.randn(2, 16, 2, 8, 12, generator=g), "timestep": torch.rand(2, generator=g) * 1000,
           "context": torch.randn(2, 7, 4096, generator=g)}
    cfg2, u2 = ParallelConfig(cfg_degree=2), ParallelConfig(ulysses_degree=2)
    pool = WorkerPool(device="cpu", max_models=2)
    pool.split_kernel_worlds = True  # cfg 2 and ulysses 2 are two worlds (ComfyUI's kernel is not pytorch's)
    try:
        assert cfg2.world_key(True) != u2.world_key(True)
        _load(pool, cfg2, "a", a)
        assert rel(_forward(pool, cfg2, "a", inp), comfy_forward(a, inp)) <= 1e-5

        listing, armed, seen = threading.Event(), [True], {}
        original = transport.list_prefix

        def list_prefix(prefix):  # the teardown's look at the directory, held until a late file exists
            if armed[0] and threading.current_thread().name == "restart":
                armed[0] = False
                seen["before"] = set(pool._written)
                listing.set()
                for _ in range(3000):
                    late = set(pool._written) - seen["before"]
                    if any(transport.os.path.exists(transport._path(n, prefix)) for n in late):
                        seen["late"] = late
                        break
                    threading.Event().wait(0.01)
            return original(prefix)
        monkeypatch.setattr(transport, "list_prefix", list_prefix)

        restart = threading.Thread(target=pool.ensure_world, args=(u2,), name="restart")
        starting = threading.Lock()

        def adopt(name, mapped):  # after each weight written: the prestart starts; the writers wait for its look
            with starting:  # (the writers are several threads)
                if restart.ident is None:
                    restart.start()
            assert listing.wait(60), "the world restart never listed the pool's files"

        _load(pool, u2, "b", b, adopt=adopt)
        restart.join(120)
        assert seen.get("late"), "no weight file was named and written while the teardown looked: nothing was tested"
        assert pool.world.config.world_key(True) == u2.world_key(True)
        err = rel(_forward(pool, u2, "b", inp), comfy_forward(b, inp))
        print(f"model B under ulysses 2, loaded across a world restart: rel {err:.2e}")
        assert err <= 1e-5, err
        monkeypatch.setattr(transport, "list_prefix", original)
        _load(pool, u2, "a", a)  # a third prompt: the first model again, on the new world
        assert rel(_forward(pool, u2, "a", inp), comfy_forward(a, inp)) <= 1e-5
        assert set(transport.list_prefix(pool.shm_prefix)) <= pool.arena_files()  # nothing left behind
    finally:
        pool.close()
