import os
import sys
from pathlib import Path

import pytest

# The tests live in folders by concept (engine, pool, driver, families, server_e2e, node_classes, web, doctor,
# package); the shared fixtures and helpers stay here in tests/. A few test modules reuse another's model builders
# (`from test_native_pool import inputs`): every folder is importable from any test, whichever ran first.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

from comfy_server import CountingServer, third_party, write_checkpoints  # noqa: F401 (third_party: the tests import it here)
from dist_harness import DistPool

# Every core, as users run ComfyUI: this process (ComfyUI's own forwards and KSampler runs here are the in-process
# references), the ComfyUI servers, the doctor, the main job and the node probe it starts. Each computes only while no
# worker does (a pool run waits; the runtime drops the driver to one thread meanwhile), the workers set their own
# counts (launch.worker_threads: cores / ranks), and a lone worker takes its driver's count, so degree 1 stays bitwise.
# The gloo test worlds (dist_harness) run one thread per rank. (One thread everywhere was the setting before
# 2026-11-29: the server, web, families and driver folders took 1,709 s here then, 1,276 s with this and that day's
# other cuts.)
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Strict mode (parallel/strict.py): every pool worker of the session - the tests' own pools and the real ComfyUI
# server's - fails where NCCL on GPUs would (host tensors in collectives or meeting device tensors, collectives
# issued in different orders, p2p tags). HP_STRICT_COMM=0 turns it off for a run.
os.environ.setdefault("HP_STRICT_COMM", "1")


def pytest_collection_modifyitems(session, config, items):
    """Run the tests in the order the suite ran in one flat folder: by test file name across the folders (a stable
    sort: each file's own order kept). Why: the session's ComfyUI server, pools and gloo worlds live for the whole run
    and their memory grows in the order tests come; in folder order every in-process family test ran before the server
    tests, and the Qwen-Image template's four ranks were killed for memory on a 24 GB machine - the order below is
    the one CI has run within its memory. HP_TEST_ORDER=reverse runs the files in the opposite order (each file's own
    order still kept): the proof that no test depends on what an earlier file left behind."""
    order = os.environ.get("HP_TEST_ORDER", "name")
    if order not in ("name", "reverse"):
        raise pytest.UsageError(f"HP_TEST_ORDER={order!r}: use 'name' (the default) or 'reverse'")
    items.sort(key=lambda item: Path(str(item.fspath)).name, reverse=order == "reverse")


@pytest.fixture(scope="session")
def dist_pools():
    """get(n) -> a DistPool of n gloo ranks, spawned once per session and reused by every test."""
    pools = {}

    def get(n: int) -> DistPool:
        if n not in pools:
            pools[n] = DistPool(n)
        return pools[n]

    yield get
    for p in pools.values():
        p.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The session's one real ComfyUI server (ComfyUI takes ~15 s to start on 2 cores): the e2e tests and the
    web tests (routes, browser) share it. Tiny SD3 / PixArt / Wan checkpoints, a tiny LoRA
    and the shipped demo model are on disk; the tests' GGUF loader is in its custom_nodes."""
    from comfy_env import setup_comfy
    comfy_dir = setup_comfy()
    base = tmp_path_factory.mktemp("comfy_base")
    srv = CountingServer(comfy_dir, base)  # on every core (OMP_NUM_THREADS above): KSampler's references ~1.6x faster
    import shutil
    from pathlib import Path
    # the tests' GGUF loader node (ComfyUI-GGUF's contract; tests/server_e2e/test_comfyui_gguf.py)
    shutil.copytree(Path(__file__).parent / "hp_gguf_loader", base / "custom_nodes" / "hp_gguf_loader")
    # HiDream-O1's sizes from a tiny checkpoint's metadata (tests/server_e2e/test_comfyui_hidream_o1.py; inert else)
    shutil.copytree(Path(__file__).parent / "hp_tiny_sizes", base / "custom_nodes" / "hp_tiny_sizes")
    for pack in third_party():  # the packs users chain (real ones by hand, else the tests' stand-ins of them)
        shutil.copytree(pack, base / "custom_nodes" / pack.name)
    write_checkpoints(base, ("sd3", "pixart", "wan"))
    from demo_model.workflow import install  # examples/ is on sys.path (comfy_server)
    install(base)  # the shipped demo model (tests/server_e2e/test_demo_model.py)
    _write_tiny_lora(base / "models" / "loras" / "tiny_lora.safetensors")
    srv.start()
    yield srv
    srv.stop()


def _write_tiny_lora(path):
    """A rank-4 LoRA on every joint block's image qkv of the tiny SD3 (ComfyUI's generic key format)."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(9)
    sd = {}
    for i in range(4):
        k = f"diffusion_model.joint_blocks.{i}.x_block.attn.qkv"
        sd[f"{k}.lora_up.weight"] = torch.randn(3 * 256, 4, generator=g) * 0.2
        sd[f"{k}.lora_down.weight"] = torch.randn(4, 256, generator=g) * 0.2
    save_file(sd, str(path))


@pytest.fixture(scope="session")
def forks(tmp_path_factory):
    """One fork server (workers/forkserver.py) for the session's in-process pools: its imports are paid once, not by
    each pool's first world (a pool without it starts its own, as a user's does)."""
    from comfyui_hybrid_parallel.workers.forkserver import ForkServer
    server = ForkServer(str(tmp_path_factory.mktemp("forks")))
    yield server
    server.close()


@pytest.fixture(scope="module")
def cpu_pool(forks):
    """A real CPU worker pool for one test module (four resident models per worker), closed after it."""
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    p = WorkerPool(device="cpu", max_models=4, forks=forks)
    yield p
    p.close()
