"""A real ComfyUI server, headless, with this pack in its custom_nodes: the main job's and the tests'.

Started once per run on a private base directory (models, outputs, log); the caller writes the model files
into its models folders. The flags and the readiness poll are the ones measured in shared/examples; the
example nodes (examples/hp_example_nodes) are copied in beside the pack.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, comfy_dir: Path, base: Path, spares: int = 0, env: dict | None = None):
        self.comfy_dir, self.base = Path(comfy_dir), Path(base)
        self.env = dict(env or {})  # more of the server's environment (HP_PRESTART: tests/server_e2e/test_comfyui_spares.py)
        # HP_SPARE_WORKERS: the pack's head start (its fork server started when a workflow opens, workers/forkserver.py):
        # off by default, so that nothing starts before a prompt; tests/server_e2e/test_comfyui_spares.py turns it on
        self.spares = spares
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        (self.base / "custom_nodes").mkdir(parents=True, exist_ok=True)
        for sub in ("diffusion_models", "vae", "loras"):
            (self.base / "models" / sub).mkdir(parents=True, exist_ok=True)
        link = self.base / "custom_nodes" / "hybrid_parallel_under_test"
        if not link.exists():
            link.symlink_to(REPO, target_is_directory=True)
        ex = self.base / "custom_nodes" / "hp_example_nodes"
        if not ex.exists():
            shutil.copytree(REPO / "examples" / "hp_example_nodes", ex)

    def start(self, timeout_s: float = 180.0, tries: int = 3) -> "ComfyServer":
        """Start and wait until our nodes are registered; a port taken meanwhile is retried on another."""
        for attempt in range(tries):
            try:
                return self._start_once(timeout_s)
            except RuntimeError as e:
                if "address already in use" not in str(e) or attempt == tries - 1:
                    raise
                self.port = _free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> "ComfyServer":
        self.log = open(self.base / "comfyui.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", HP_SPARE_WORKERS=str(self.spares), **self.env)
        self.proc = subprocess.Popen(
            [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
             "--base-directory", str(self.base), "--disable-auto-launch", "--database-url", "sqlite:///:memory:",
             "--preview-method", "latent2rgb"],  # previews go only to a client that asked (tests/server_e2e/test_comfyui_previews.py)
            cwd=self.comfy_dir, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                info = self.get("/object_info/HybridSampler")
                if "HybridSampler" in info:
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ComfyUI did not get ready in {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "".join(open(self.base / "comfyui.log").readlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.load(r)

    def post(self, path: str, payload: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read()
                return json.loads(body) if body else {}
        except urllib.error.HTTPError as e:
            return {"http_error": e.code, "body": json.loads(e.read() or b"{}")}

    def run(self, graph: dict, timeout_s: float = 600.0) -> dict:
        """Queue an API prompt and wait for its /history entry (status + outputs)."""
        resp = self.post("/prompt", {"prompt": graph, "client_id": str(uuid.uuid4())})
        if "prompt_id" not in resp:
            return {"rejected": resp}
        pid = resp["prompt_id"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            h = self.get(f"/history/{pid}")
            if pid in h and h[pid].get("status", {}).get("completed") is not None:
                return h[pid]
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI died while running a prompt:\n{self.tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"prompt {pid} did not finish in {timeout_s:.0f} s:\n{self.tail()}")

    @staticmethod
    def seconds(entry: dict) -> float:
        """How long ComfyUI executed a finished prompt (its own execution_start -> execution_success timestamps,
        in ms): what a timing should report, without this client's HTTP polling."""
        stamps = {m[0]: m[1].get("timestamp") for m in entry.get("status", {}).get("messages", [])}
        if stamps.get("execution_start") is None or stamps.get("execution_success") is None:
            raise ValueError(f"the prompt did not execute successfully: {entry.get('status')}")
        return (stamps["execution_success"] - stamps["execution_start"]) / 1000

    def wait(self, prompt_id: str, timeout_s: float = 120.0) -> dict:
        """A queued prompt's /history entry once it completed (success, error or interrupted)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            h = self.get(f"/history/{prompt_id}")
            if prompt_id in h and h[prompt_id].get("status", {}).get("completed") is not None:
                return h[prompt_id]
            time.sleep(0.02)
        raise TimeoutError(self.tail())

    def _processes(self) -> list:
        """(pid, ppid, command line) of every process on this machine (Linux /proc)."""
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out.append((int(d), ppid, cmd))
        return out

    def fork_server_pids(self, procs: list | None = None) -> list:
        """The pack's fork servers (workers/forkserver.py) this server started (sorted)."""
        return sorted(pid for pid, ppid, cmd in (procs or self._processes())
                      if ppid == self.proc.pid and "workers.forkserver_main --driver-pid" in cmd)

    def worker_pids(self) -> list:
        """Our pool's worker processes (sorted): forks of this server's fork server, or its children running the
        worker module as fresh interpreters."""
        procs = self._processes()
        servers = set(self.fork_server_pids(procs))
        return sorted(pid for pid, ppid, cmd in procs if ppid in servers or (
            ppid == self.proc.pid and "worker_main" in cmd and pid not in servers))

    def output(self, name: str) -> Path:
        return self.base / "output" / name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


PARALLEL_DEFAULTS = {"dp_degree": 1, "cfg_degree": 1, "ulysses_degree": 1, "ring_degree": 1, "pp_degree": 1,
                     "num_pipeline_patch": 0, "warmup_steps": 1, "tp_degree": 1, "method": "usp", "device": "cpu",
                     "attention": "auto", "devices": ""}


def parallel_config_node(degrees: dict) -> dict:
    """A Parallel Config node of the API prompt with these widget values over the defaults (CPU workers)."""
    return {"class_type": "HybridParallelConfig", "inputs": {**PARALLEL_DEFAULTS, **degrees}}


def sample_decode_save(g: dict, common: dict, degrees, tag: str, png: bool = False) -> dict:
    """Finish API prompt `g` (the VAE is node "6"): KSampler -> VAEDecode when `degrees` is None, else Parallel
    Config(degrees) (node "9") -> Hybrid Sampler -> Parallel VAE Decode; `common` is the sampler's inputs. The image
    and the latent are saved losslessly as output/img_<tag> / lat_<tag>.safetensors (and as a PNG when `png`)."""
    if degrees is None:
        g["5"] = {"class_type": "KSampler", "inputs": common}
        g["7"] = {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["6", 0]}}
    else:
        g["9"] = parallel_config_node(degrees)
        g["5"] = {"class_type": "HybridSampler", "inputs": {**common, "parallel_config": ["9", 0]}}
        g["7"] = {"class_type": "HybridPatchVAEDecode", "inputs": {"samples": ["5", 0], "vae": ["6", 0],
                                                                   "parallel_config": ["9", 0]}}
    g["8"] = {"class_type": "HPSaveImageTensor", "inputs": {"images": ["7", 0], "filename": f"img_{tag}"}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    if png:
        g["11"] = {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": tag}}
    return g
