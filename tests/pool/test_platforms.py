"""What the pack does on Linux, macOS and Windows (workers/platform_support.py), checked on this Linux machine.

Why: ComfyUI runs on all three, and a custom node that fails to import - or starts workers that cannot work - breaks
the user's ComfyUI. The decision is tested on injected facts; the pool is shown to refuse before it spawns anything;
importing the pack is simulated under Windows and macOS in a subprocess (sys.platform changed and socket.AF_UNIX
or /dev/shm taken away before the pack's modules run); and macOS's real difference for the pool - no /dev/shm, so
tensors go through the temp dir - runs end to end on a 2-rank gloo world whose driver and workers cannot see
/dev/shm.
"""
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import WorkerPool
from comfyui_hybrid_parallel.workers import platform_support as ps
from comfyui_hybrid_parallel.workers.platform_support import (Facts, check_os, check_platform, check_pool, decide,
                                                              describe_platform)

SP2 = ParallelConfig(ulysses_degree=2)
ONE = ParallelConfig()


def _facts(system="linux", **kw) -> Facts:
    base = dict(distributed=True, gloo=True, nccl=True, cuda=True, unix_socket=True, dev_shm=True)
    return Facts(system=system, **{**base, **kw})


# ---- the decision on injected facts ----
def test_linux_runs_everything():
    s = decide(_facts())
    assert (s.system, s.cpu, s.cuda, s.shared_gpus, s.tested) == ("Linux", True, True, True, True)
    for kind in ("auto", "cpu", "cuda"):
        check_platform(kind, facts=_facts())
    line = describe_platform(_facts())
    assert line.startswith("worker pool on Linux: GPU ranks over NCCL, CPU ranks over gloo")
    assert "/dev/shm" in line and "not tested" not in line


def test_linux_without_nccl_or_gloo_or_dev_shm():
    no_nccl = _facts(nccl=False)
    assert decide(no_nccl).cpu and not decide(no_nccl).cuda
    with pytest.raises(ValueError, match="no NCCL.*Linux"):
        check_platform("cuda", facts=no_nccl)
    with pytest.raises(ValueError, match="no NCCL"):
        check_platform("auto", facts=no_nccl)  # auto means the GPUs when torch sees some
    check_pool("cuda", share_devices=True, facts=no_nccl)  # ranks sharing GPUs talk gloo
    check_pool("cuda", world_size=1, facts=no_nccl)  # one rank joins no process group
    assert "no GPU ranks" in describe_platform(no_nccl)
    with pytest.raises(ValueError, match="no gloo"):
        check_platform("cpu", facts=_facts(gloo=False))
    with pytest.raises(ValueError, match="without torch.distributed"):
        check_platform("cpu", facts=_facts(distributed=False, gloo=False, nccl=False))
    cpu_only = _facts(cuda=False, nccl=False, dev_shm=False)
    check_platform("auto", facts=cpu_only)
    with pytest.raises(ValueError, match="no CUDA device"):
        check_pool("cuda", facts=_facts(cuda=False))
    assert "temp dir" in describe_platform(cpu_only) and "no GPU ranks" not in describe_platform(cpu_only)


def test_macos_gets_cpu_ranks_only_and_says_it_is_untested():
    mac = _facts("darwin", cuda=False, nccl=False, dev_shm=False, mps=True)
    s = decide(mac)
    assert (s.system, s.cpu, s.cuda, s.shared_gpus, s.tested) == ("macOS", True, False, False, False)
    assert "temp dir" in s.transport
    check_platform("cpu", facts=mac)
    check_platform("auto", facts=mac)  # auto = CPU ranks there (no CUDA; MPS is never used)
    with pytest.raises(ValueError, match="macOS has no CUDA.*MPS"):
        check_platform("cuda", facts=mac)
    line = describe_platform(mac)
    assert line.startswith("worker pool on macOS: CPU ranks over gloo") and "not tested on macOS" in line
    assert "MPS" in line and "temp dir" in line


@pytest.mark.parametrize("system", ["win32", "cygwin"])
def test_windows_gets_no_pool_and_the_fix(system):
    win = _facts(system, nccl=False, unix_socket=False, dev_shm=False)
    s = decide(win)
    assert (s.system, s.cpu, s.cuda, s.tested) == ("Windows", False, False, False)
    for kind in ("auto", "cpu", "cuda"):
        with pytest.raises(ValueError, match="multi-GPU needs Linux with NCCL; on Windows run ComfyUI inside WSL2"):
            check_platform(kind, facts=win)
    with pytest.raises(ValueError, match="WSL2"):  # even one rank or fake workers: the channel itself cannot work
        check_pool("cpu", world_size=1, facts=win)
    with pytest.raises(ValueError, match="WSL2"):
        check_os(win)
    assert check_os(_facts()).system == "Linux"
    assert describe_platform(win).startswith("worker pool on Windows: none (multi-GPU needs Linux")


def test_bad_device_kind_and_facts_read_through_small_functions(monkeypatch):
    with pytest.raises(ValueError, match="'auto', 'cpu' or 'cuda'"):
        check_platform("mps", facts=_facts())
    monkeypatch.setattr(ps, "_system", lambda: "darwin")
    monkeypatch.setattr(ps, "_dev_shm", lambda: False)
    monkeypatch.setattr(ps, "_torch_facts", lambda: dict(distributed=True, gloo=True, nccl=False, cuda=False,
                                                         mps=True))
    f = ps.read_facts()
    assert (f.system, f.dev_shm, f.unix_socket, f.mps) == ("darwin", False, True, True)
    assert describe_platform().startswith("worker pool on macOS")


# ---- the pool refuses before anything starts ----
def test_pool_refuses_on_windows_before_spawning(monkeypatch):
    monkeypatch.setattr(ps, "_system", lambda: "win32")
    for pool in (WorkerPool(fake="serve"), WorkerPool(device="cpu"), WorkerPool(device="auto")):
        with pool:
            with pytest.raises(ValueError, match="WSL2"):
                pool.submit(SP2, "steps", {"n": 1})
            assert pool.generation == 0 and pool.world is None


def test_pool_refuses_a_torch_without_gloo_before_spawning(monkeypatch):
    monkeypatch.setattr(ps, "_torch_facts", lambda: dict(distributed=True, gloo=False, nccl=False, cuda=False,
                                                         mps=False))
    with WorkerPool(device="cpu") as pool:
        with pytest.raises(ValueError, match="no gloo backend"):
            pool.ensure_world(SP2)
        assert pool.generation == 0 and pool.world is None


def test_control_socket_path_too_long_for_a_unix_socket_uses_loopback_tcp(monkeypatch, tmp_path):
    """A long TMPDIR (macOS's sun_path holds 104 bytes): the control channel goes over loopback TCP, still behind
    the HMAC challenge, instead of failing to bind."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with WorkerPool(fake="serve") as pool:
        assert pool.submit(SP2, "steps", {"n": 2}).values["steps"] == 2
        assert pool.world.address.startswith("127.0.0.1:"), pool.world.address
        assert len(os.fsencode(os.path.join(pool.tmpdir, "ctl-1.sock"))) > 104


# ---- importing the pack as Windows and macOS would ----
# Hides /dev/shm from this process and every worker it starts (they inherit PYTHONPATH): what macOS lacks.
_SITECUSTOMIZE = """
import os
if os.environ.get("HP_TEST_HIDE_DEV_SHM") == "1":
    _isdir, _access = os.path.isdir, os.access
    def _hidden(p):
        try:
            return os.fsdecode(os.fspath(p)).startswith("/dev/shm")
        except TypeError:
            return False
    os.path.isdir = lambda p: False if _hidden(p) else _isdir(p)
    os.access = lambda p, mode, **kw: False if _hidden(p) else _access(p, mode, **kw)
"""

# The third-party modules the pack imports are imported first under the real platform (they have their own
# Windows and macOS code; only the pack's own module-level code is under test), then the pack is imported again
# from scratch as the simulated platform.
_SIMULATE = """
import os, socket, sys, tempfile
import comfyui_hybrid_parallel
for name in [m for m in sys.modules if m == "comfyui_hybrid_parallel" or m.startswith("comfyui_hybrid_parallel.")]:
    del sys.modules[name]
SYSTEM = sys.argv[1]
sys.platform = SYSTEM
if SYSTEM == "win32":
    del socket.AF_UNIX
import comfyui_hybrid_parallel as pack
from comfyui_hybrid_parallel.workers import platform_support as ps
assert len(pack.NODE_CLASS_MAPPINGS) >= 5 and "HybridSampler" in pack.NODE_CLASS_MAPPINGS
print("IMPORTED", sorted(pack.NODE_CLASS_MAPPINGS), flush=True)
print("DESCRIBE", ps.describe_platform(), flush=True)
"""

_WINDOWS = _SIMULATE + """
from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import WorkerPool
for kind in ("auto", "cpu", "cuda"):
    try:
        ps.check_platform(kind)
        print("NOT_REFUSED", kind)
    except ValueError as e:
        print("REFUSED", kind, e, flush=True)
with WorkerPool(fake="serve") as pool:
    try:
        pool.submit(ParallelConfig(ulysses_degree=2), "steps", {"n": 1})
        print("POOL_STARTED")
    except ValueError as e:
        print("POOL_REFUSED", pool.generation, pool.world is None, e, flush=True)
"""

_MACOS = _SIMULATE + """
import torch
from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import WorkerPool
from comfyui_hybrid_parallel.workers.transport import list_prefix, shm_dir
s = ps.decide(ps.read_facts())
print("DECIDED", s.system, s.cpu, s.cuda, s.tested, flush=True)
ps.check_platform("cpu")
ps.check_platform("auto")
try:
    ps.check_platform("cuda")
    print("CUDA_NOT_REFUSED")
except ValueError as e:
    print("CUDA_REFUSED", e, flush=True)
print("SHM_DIR", shm_dir(), flush=True)
SP2 = ParallelConfig(ulysses_degree=2)
with WorkerPool(device="cpu", start_timeout_s=120, job_timeout_s=120) as pool:
    r = pool.submit(SP2, "steps", {"n": 3})
    print("STEPS", [v["value"] for v in r.per_rank], flush=True)  # all-reduced over gloo
    tensors = {"f": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.bfloat16), "big": torch.randn(1 << 16)}
    out = pool.submit(SP2, "echo", {}, tensors).tensors
    print("ECHO", all(torch.equal(out[k], t) for k, t in tensors.items()), flush=True)
    print("FILES", sorted({os.path.dirname(p) for p in list_prefix(pool.shm_prefix)}), flush=True)
    print("IN_DEV_SHM", [n for n in os.listdir("/dev/shm") if n.startswith(pool.shm_prefix)], flush=True)
    prefix = pool.shm_prefix
print("LEFT", list_prefix(prefix), flush=True)
"""


def _spawn(code: str, system: str, shim_dir, hide_shm: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(shim_dir), os.environ.get("PYTHONPATH"))
                                                      if p),
           "HP_TEST_HIDE_DEV_SHM": "1" if hide_shm else "0", "HP_SHM_DIR": "", "HP_SHM_FALLBACK_DIR": ""}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), system], env=env, cwd=str(shim_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """Both simulations at once (each imports torch; two cores): {system: (returncode, stdout, stderr)}."""
    shim = tmp_path_factory.mktemp("platform_shim")
    (shim / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    procs = {"win32": _spawn(_WINDOWS, "win32", shim, hide_shm=True),
             "darwin": _spawn(_MACOS, "darwin", shim, hide_shm=True)}
    out = {}
    t0 = time.monotonic()
    for system, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(10.0, 240 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out[system] = (p.returncode, stdout, stderr)
    return out


def test_windows_import_works_and_using_the_nodes_names_the_fix(simulated):
    code, out, err = simulated["win32"]
    assert code == 0, (out, err[-4000:])
    assert "IMPORTED" in out and "DESCRIBE worker pool on Windows: none" in out, out
    for kind in ("auto", "cpu", "cuda"):
        assert f"REFUSED {kind} Hybrid Parallel: this is Windows: multi-GPU needs Linux with NCCL; on Windows run " \
               f"ComfyUI inside WSL2" in out, out
    assert "NOT_REFUSED" not in out and "POOL_STARTED" not in out
    assert "POOL_REFUSED 0 True" in out, out  # no world, no process


def test_macos_import_works_and_cpu_ranks_run_through_the_temp_dir(simulated):
    code, out, err = simulated["darwin"]
    assert code == 0, (out, err[-4000:])
    assert "IMPORTED" in out and "DECIDED macOS True False False" in out, out
    assert "DESCRIBE worker pool on macOS: CPU ranks over gloo" in out and "not tested on macOS" in out, out
    assert "CUDA_REFUSED Hybrid Parallel: GPU worker ranks cannot run here: macOS has no CUDA" in out, out
    tmp = tempfile.gettempdir()
    assert f"SHM_DIR {tmp}\n" in out, out
    assert "STEPS [9.0, 9.0]" in out and "ECHO True" in out, (out, err[-4000:])
    assert f"FILES ['{tmp}']" in out and "IN_DEV_SHM []" in out and "LEFT []" in out, out


# ---- the doctor ----
def test_doctor_prints_the_platform_line_and_stops_where_no_pool_can_run(monkeypatch, tmp_path, capsys):
    from comfyui_hybrid_parallel.doctor import cli
    from comfyui_hybrid_parallel.doctor.machine import environment
    assert environment(None)["pool"] == describe_platform()
    monkeypatch.setattr(ps, "_system", lambda: "win32")
    assert cli.main(["--json", str(tmp_path / "r.json"), "--comfyui", str(tmp_path)]) == cli.EXIT_CANNOT_RUN
    out, err = capsys.readouterr()
    assert "worker pool on Windows: none" in out and "WSL2" in err
