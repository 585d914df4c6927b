"""The package as a GPU owner installs it: inside ComfyUI's environment, from the Comfy registry or `pip install -e .`.

Why: a pinned `torch==...` in [project] dependencies made `pip install -e .` in ComfyUI's venv replace ComfyUI's
CUDA torch with another build - the one way installing a node pack can break ComfyUI itself. The pins CI needs
live in constraints.txt. Fast and offline: the resolver run uses the venv's own setuptools and no index.
"""
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "safetensors", "numpy")  # what a ComfyUI install already has its own build of
# versions real ComfyUI installs carry (portable builds, pip's CUDA wheels, plain PyPI) - all must be kept
COMFY_VERSIONS = {"torch": ["2.4.1+cu121", "2.5.1+cu124", "2.6.0+cu126", "2.7.0+cu128", "2.8.0+cu129", "2.9.1",
                            "2.13.0+cpu"],
                  "safetensors": ["0.4.5", "0.5.3", "0.6.2", "0.8.0"],
                  "numpy": ["1.26.4", "2.2.6", "2.4.6"]}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(lines) -> dict:
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            out[r.name.lower()] = r
    return out


def test_dependencies_are_lower_bounds_that_keep_comfyuis_builds():
    deps = _requirements(_pyproject()["project"]["dependencies"])
    assert set(HEAVY) <= set(deps), sorted(deps)
    for name in HEAVY:
        spec = deps[name].specifier
        ops = {s.operator for s in spec}
        assert ops == {">="}, f"{name}: only a lower bound may appear (no pin, no ~=, no upper bound): {spec}"
        for v in COMFY_VERSIONS[name]:
            assert spec.contains(v, prereleases=True), f"{name}{spec} would replace ComfyUI's {name} {v}"


def test_diffusers_is_no_dependency():
    """The nodes, the workers, the engine and the tests run ComfyUI's own modules: diffusers is no dependency that
    ComfyUI-Manager or pip would install or replace, nor one the tests need; only the bench extra lists it (the peer
    baseline of bench/bench_ulysses_peer.py), with a lower bound only."""
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    assert "diffusers" not in _requirements(project["dependencies"])
    assert "diffusers" not in _requirements((ROOT / "requirements.txt").read_text().splitlines())
    assert "diffusers" not in extras and "diffusers" not in _requirements(extras["test"])
    spec = _requirements(extras["bench"])["diffusers"].specifier
    assert {s.operator for s in spec} == {">="} and all(spec.contains(v) for v in ("0.35.1", "0.36.0", "0.42.1"))


def test_requirements_txt_leaves_torch_to_comfyui_and_agrees_with_pyproject():
    """ComfyUI-Manager installs requirements.txt: no torch line at all, and the same lower bounds."""
    reqs = _requirements((ROOT / "requirements.txt").read_text().splitlines())
    assert "torch" not in reqs and not any(n.startswith("torch") for n in reqs), sorted(reqs)
    deps = _requirements(_pyproject()["project"]["dependencies"])
    for name, r in reqs.items():
        assert name in deps, f"requirements.txt lists {name}, pyproject does not"
        assert {s.operator for s in r.specifier} <= {">="}, f"requirements.txt pins {r}"
        assert r.specifier == deps[name].specifier, (r, deps[name])


def test_constraints_pin_ci_within_the_ranges():
    """CI and the README's fresh machine get exact versions through constraints.txt (scripts/setup_env.sh installs
    with -c): each pin must be exact and inside the pyproject range, or that install would not resolve."""
    pins = _requirements((ROOT / "constraints.txt").read_text().splitlines())
    deps = _requirements(_pyproject()["project"]["dependencies"])
    for name in HEAVY:
        (pin,) = list(pins[name].specifier)
        assert pin.operator == "==", pins[name]
        assert deps[name].specifier.contains(pin.version), (deps[name], pin)
    assert pins["torch"].specifier == SpecifierSet("==2.13.0")  # the CPU build the README's numbers come from
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup_env.sh").read_text()


def test_editable_install_keeps_the_installed_torch(tmp_path):
    """pip's own resolver, offline, in this venv (which holds its own torch build): installing the pack editable
    installs the pack and nothing else - torch and safetensors stay as they are."""
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(report), "--no-index",
                          "--no-build-isolation", "-q", "-e", str(ROOT)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    installs = [i["metadata"] for i in json.loads(report.read_text())["install"]]
    assert [(m["name"], m["version"]) for m in installs] == [("comfyui-hybrid-parallel", _pyproject()["project"]["version"])]
    assert not re.search(r"(?i)deprecat|warning", res.stderr), res.stderr  # setuptools accepts the metadata as is


def test_license_is_the_gpl3_and_pyproject_agrees():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("GNU GENERAL PUBLIC LICENSE") and "Version 3, 29 June 2007" in text[:200]
    assert "TERMS AND CONDITIONS" in text and "END OF TERMS AND CONDITIONS" in text
    assert "How to Apply These Terms to Your New Programs" in text and len(text.splitlines()) == 674
    project = _pyproject()["project"]
    assert project["license"] == "GPL-3.0-or-later" and project["license-files"] == ["LICENSE"]
    # PEP 639: the SPDX expression replaces License classifiers (setuptools refuses both together)
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))


def test_comfy_registry_fields():
    """docs.comfy.org/registry/specifications, as comfy-cli's parser reads them: PublisherId, DisplayName, a URL
    as Icon, requires-comfyui as [op]X.Y.Z; OS / accelerator classifiers from its lists only."""
    data = _pyproject()
    comfy, project = data["tool"]["comfy"], data["project"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert "Icon" not in comfy or comfy["Icon"].startswith("https://"), comfy.get("Icon")
    repo = project["urls"]["Repository"].removeprefix("https://github.com/")
    if "Icon" in comfy and "raw.githubusercontent.com" in comfy["Icon"]:
        assert comfy["Icon"].startswith(f"https://raw.githubusercontent.com/{repo}/")
        assert (ROOT / comfy["Icon"].split(f"{repo}/", 1)[1].split("/", 1)[1]).is_file(), comfy["Icon"]
    assert comfy["requires-comfyui"] == ">=0.3.75"
    assert re.fullmatch(r"(>=|==|<=|!=|~=|>|<)?\s*\d+\.\d+\.\d+", comfy["requires-comfyui"])
    classifiers = project["classifiers"]
    assert "Operating System :: POSIX :: Linux" in classifiers
    # an OS is listed only where the pool is tested (workers/platform_support.py): the nodes load on macOS and
    # Windows, but the registry's OS filter means "works here"
    from comfyui_hybrid_parallel.workers.platform_support import Facts, decide
    systems = {"Operating System :: POSIX :: Linux": "linux", "Operating System :: MacOS": "darwin",
               "Operating System :: Microsoft :: Windows": "win32"}
    for c in classifiers:
        if c.startswith("Operating System :: "):
            facts = Facts(system=systems[c], distributed=True, gloo=True, nccl=True, cuda=True, unix_socket=True,
                          dev_shm=True)
            assert decide(facts).tested, f"{c} is listed but the pool is not tested there"
    assert "Environment :: GPU :: NVIDIA CUDA" in classifiers
    for c in classifiers:
        if c.startswith("Operating System :: "):
            assert c.split(" :: ")[1] in ("Microsoft", "POSIX", "MacOS", "OS Independent"), c
        if c.startswith("Environment :: "):
            assert c in ("Environment :: GPU :: NVIDIA CUDA", "Environment :: GPU :: AMD ROCm",
                         "Environment :: GPU :: Intel Arc", "Environment :: NPU :: Huawei Ascend",
                         "Environment :: GPU :: Apple Metal"), c
    assert f"Programming Language :: Python :: {sys.version_info.major}.{sys.version_info.minor}" in classifiers
    assert SpecifierSet(project["requires-python"]).contains(f"{sys.version_info.major}.{sys.version_info.minor}")


def test_test_files_have_unique_names_across_folders():
    """The test folders are not packages (pytest imports each test file by its name), so two files of one name in two
    folders stop the whole collection ("import file mismatch"): caught here, by name."""
    tests = Path(__file__).resolve().parents[1]
    seen = {}
    for f in sorted(tests.rglob("test_*.py")):
        seen.setdefault(f.name, []).append(str(f.relative_to(tests)))
    assert len(seen) > 100, "the scan found too few test files: it is broken"
    assert not {n: p for n, p in seen.items() if len(p) > 1}
