"""Test helpers around the headless ComfyUI server (examples/comfy_headless.py): the tiny checkpoints each
family's workflow loads and the API prompts the end-to-end tests post."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "examples") not in sys.path:
    sys.path.insert(0, str(REPO / "examples"))

from comfy_headless import (PARALLEL_DEFAULTS, ComfyServer, parallel_config_node,  # noqa: E402,F401
                            sample_decode_save)  # (re-exported for the tests)


FAMILIES = {  # the tiny checkpoints each family's workflow loads, and the shapes its conditioning needs
    "sd3": dict(unet="tiny_sd3.safetensors", vae="tiny_kl16.safetensors", latent="EmptySD3LatentImage",
                tokens=7, context_dim=32, pooled_dim=24),
    "pixart": dict(unet="tiny_pixart.safetensors", vae="tiny_kl4.safetensors", latent="EmptyLatentImage",
                   tokens=8, context_dim=4096, pooled_dim=0),
    "wan": dict(unet="tiny_wan.safetensors", vae="tiny_wan_vae.safetensors", latent="EmptyHunyuanLatentVideo",
                tokens=7, context_dim=4096, pooled_dim=0),
    # Qwen-Image: 24 heads x 128 and a 3584-wide text input are fixed (0.38B parameters with one block); written
    # on demand by its test, with the Wan 2.1 VAE it uses
    "qwen_image": dict(unet="tiny_qwen_image.safetensors", vae="tiny_wan_vae.safetensors",
                       latent="EmptySD3LatentImage", tokens=7, context_dim=3584, pooled_dim=0),
    # Lumina 2 (NextDiT): detection maps width 2304 to 24 heads x 96, so one main layer (and the two refiner
    # blocks of each kind it always has) is 0.42B parameters; written on demand by its test; Flux's VAE
    "lumina2": dict(unet="tiny_lumina2.safetensors", vae="tiny_kl16.safetensors", latent="EmptySD3LatentImage",
                    tokens=7, context_dim=32, pooled_dim=0),
    # HunyuanVideo 1.5: small (heads = hidden / 128); 32-channel latents at 16x; written on demand by its test
    "hunyuan_video15": dict(unet="tiny_hunyuan_video15.safetensors", vae=None, latent="EmptyHunyuanVideo15Latent",
                            tokens=7, context_dim=32, pooled_dim=4),  # encode_adm reads a pooled output (unused by 1.5)
    # Chroma (0.8B) and Flux.2 (2.2B, 128-channel latents at 16x): forced sizes, written on demand by slow tests
    # (Flux's encode_adm reads a pooled output, unused by both)
    "chroma": dict(unet="tiny_chroma.safetensors", vae=None, latent="EmptySD3LatentImage", tokens=7,
                   context_dim=32, pooled_dim=4),
    "flux2": dict(unet="tiny_flux2.safetensors", vae=None, latent="EmptyFlux2LatentImage", tokens=7,
                  context_dim=32, pooled_dim=4, guidance=3.5),
    # Flux.2 Klein: the Flux2 class at width 256 (ComfyUI 0.33 reads it), no guidance embedder
    "flux2_klein": dict(unet="tiny_flux2_klein.safetensors", vae=None, latent="EmptyFlux2LatentImage", tokens=7,
                        context_dim=32, pooled_dim=4),
    # LTX-Video: 128-channel latents at 32x spatial and 8x temporal, 4096-wide captions; written on demand by its test
    "ltxv": dict(unet="tiny_ltxv.safetensors", vae=None, latent="EmptyLTXVLatentVideo", tokens=7, context_dim=4096,
                 pooled_dim=0),
    # LTX-2 (LTXAVModel): LTX-Video's video stream (head dim 8) beside an audio stream the file's metadata shrinks; the
    # text is [video, audio] captions side by side (2 x 32); the AV latent is built by the test (no audio VAE)
    "ltxav": dict(unet="tiny_ltxav.safetensors", vae=None, latent="EmptyLTXVLatentVideo", tokens=7, context_dim=64,
                  pooled_dim=0),
    # AuraFlow: width 3072 fixed by detection (0.55B with one layer of each kind), 2048-wide text; written on demand
    "auraflow": dict(unet="tiny_auraflow.safetensors", vae=None, latent="EmptyLatentImage", tokens=7, context_dim=2048,
                     pooled_dim=0),
    # Kandinsky 5 video (width 256) and image (width 2560, which detection requires): 3584-wide text, 768-wide pooled
    # text; written on demand by its test, with the HunyuanVideo / Flux latent formats their VAEs use
    "kandinsky5": dict(unet="tiny_kandinsky5.safetensors", vae=None, latent="EmptyHunyuanLatentVideo", tokens=7,
                       context_dim=3584, pooled_dim=768),
    "kandinsky5_image": dict(unet="tiny_kandinsky5_image.safetensors", vae=None, latent="EmptySD3LatentImage",
                             tokens=7, context_dim=3584, pooled_dim=768),
    # Krea 2: width 256 (2 heads of the fixed 128), a 2-layer x 320 caption; the Wan 2.1 latent format and VAE
    "krea2": dict(unet="tiny_krea2.safetensors", vae="tiny_wan_vae.safetensors", latent="EmptySD3LatentImage",
                  tokens=7, context_dim=640, pooled_dim=0),
    # CogVideoX 1.0 / 1.5 (rotary): width 128, 32-wide text; 16-channel video latents
    "cogvideox": dict(unet="tiny_cogvideox.safetensors", vae=None, latent="EmptyHunyuanLatentVideo", tokens=7,
                      context_dim=32, pooled_dim=0),
    # ERNIE-Image: the class's sizes (detection reads none: 0.35B with one layer), 3072-wide text, Flux.2 latents
    "ernie": dict(unet="tiny_ernie.safetensors", vae=None, latent="EmptyFlux2LatentImage", tokens=7,
                  context_dim=3072, pooled_dim=0),
    # MiniMax H3: width 256 (4 heads of 64), 32-wide text; a packed video + audio latent (NestedTensor)
    "minimax_h3": dict(unet="tiny_minimax_h3.safetensors", vae=None, latent="EmptyMiniMaxH3LatentAV", tokens=7,
                       context_dim=32, pooled_dim=0),
    # Cosmos Predict2 (MiniTrainDIT) and Anima (its subclass): width 256 (16 heads, as detection fixes), 1024-wide text
    # (fixed); Wan 2.1 latents (16 channels, 8x), 5-D
    "cosmos_predict2": dict(unet="tiny_cosmos_predict2.safetensors", vae=None, latent="EmptySD3LatentImage", tokens=7,
                            context_dim=1024, pooled_dim=0),
    "anima": dict(unet="tiny_anima.safetensors", vae=None, latent="EmptySD3LatentImage", tokens=7, context_dim=1024,
                  pooled_dim=0),
    # HiDream-O1: detection reads no sizes (the class's are the 8.7B Qwen3-VL), so the tiny checkpoint (width 32, real
    # vocabulary, models/checkpoints: CheckpointLoaderSimple gives its tokenizer-only text encoder) carries them in its
    # metadata for the test's size shim; the conditioning is CLIPTextEncode's token ids (`tokens`: none of the others)
    "hidream_o1": dict(unet="tiny_hidream_o1.safetensors", vae=None, latent="EmptyHiDreamO1LatentImage", tokens=0,
                       context_dim=0, pooled_dim=0),
    # SD1.5 and an SDXL-class UNet (KOALA-700M's depths at width 320): no family adapter, CFG / data parallel only;
    # written on demand by their test, with the SD VAE
    "sd15": dict(unet="tiny_sd15.safetensors", vae="tiny_kl4.safetensors", latent="EmptyLatentImage", tokens=7,
                 context_dim=768, pooled_dim=0),
    # SD1.5 with a second, twice as wide level (640: what FreeU acts on; 71M): written on demand by its test
    "sd15_2l": dict(unet="tiny_sd15_2l.safetensors", vae="tiny_kl4.safetensors", latent="EmptyLatentImage", tokens=7,
                    context_dim=768, pooled_dim=0),
    "sdxl": dict(unet="tiny_sdxl.safetensors", vae="tiny_kl4.safetensors", latent="EmptyLatentImage", tokens=7,
                 context_dim=2048, pooled_dim=1280),
    # Flux.1-dev: ComfyUI 0.3.75 fixes its width at 3072, so even one block of each kind is 531M parameters;
    # written on demand (write_flux_checkpoint), not with the others
    "flux": dict(unet="tiny_flux.safetensors", vae="tiny_kl16.safetensors", latent="EmptySD3LatentImage",
                 tokens=7, context_dim=32, pooled_dim=24, guidance=3.5),
    # LongCat-Image and Ovis-Image: ComfyUI's Flux class at width 256 with their settings (detection tells them apart)
    "longcat": dict(unet="tiny_longcat.safetensors", vae=None, latent="EmptySD3LatentImage", tokens=7,
                    context_dim=3584, pooled_dim=4),
    "ovis": dict(unet="tiny_ovis.safetensors", vae=None, latent="EmptySD3LatentImage", tokens=7, context_dim=32,
                 pooled_dim=24),
}


def write_flux_checkpoint(base: Path) -> None:
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = base / "models" / "diffusion_models" / FAMILIES["flux"]["unet"]
    if not path.exists():
        tc.write_flux(path, guidance=True, seed=11)


def write_checkpoints(base: Path, families=("sd3",)) -> None:
    """Tiny random-init checkpoints in ComfyUI's own format into base/models (needs `import comfy`)."""
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc

    unet, vae = base / "models" / "diffusion_models", base / "models" / "vae"
    if "sd3" in families:
        tc.write_sd3(unet / "tiny_sd3.safetensors", depth=4, pos_embed_max_size=48, seed=3)
        tc.write_kl_vae(vae / "tiny_kl16.safetensors", style="flux", seed=4)
    if "pixart" in families:
        tc.write_pixart(unet / "tiny_pixart.safetensors", seed=5)
        tc.write_kl_vae(vae / "tiny_kl4.safetensors", style="sd", seed=6)
    if "wan" in families:
        tc.write_wan(unet / "tiny_wan.safetensors", dim=256, ffn_dim=256, seed=7)
        tc.write_wan_vae(vae / "tiny_wan_vae.safetensors", seed=8)


def parallel_model(g: dict, degrees: dict, model=("1", 0), node_id="40") -> list:
    """Add Parallel Config (node 9) and a Parallel Model on `model` to graph `g`; returns the new MODEL link."""
    g["9"] = parallel_config_node(degrees)
    g[node_id] = {"class_type": "HybridParallelModel", "inputs": {"model": list(model), "parallel_config": ["9", 0]}}
    return [node_id, 0]


def on_pool(g: dict, degrees: dict, node: str = "model") -> dict:
    """Graph `g` (a `workflow(None, ...)` KSampler graph, sampler node "5") with its diffusion model on the pool:
    node "model" puts a Parallel Model on the KSampler's MODEL, "sampler" swaps KSampler for Hybrid Sampler."""
    if node == "model":
        g["5"]["inputs"]["model"] = parallel_model(g, degrees, model=tuple(g["5"]["inputs"]["model"]))
    else:
        g["9"] = parallel_config_node(degrees)
        g["5"] = {"class_type": "HybridSampler", "inputs": {**g["5"]["inputs"], "parallel_config": ["9", 0]}}
    return g


POOL_NODES = ("HybridSampler", "HybridParallelModel")
SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced", "HybridSampler",
            "HPTestTiledSampler")


class CountingServer(ComfyServer):
    """The test server, counting the diffusion-model calls the pool's workers served during each prompt (rank 0's
    count, /hybrid_parallel/pool): `run` puts it in the history entry as "_hp_model_calls" (None where no pool
    answered), and `assert_ok` checks it - a prompt through the pack's nodes whose sampler ran must have been served
    by the workers (an equality test would otherwise also pass if the MODEL silently ran in ComfyUI's process), and
    a prompt without them by none (KSampler's reference ran in ComfyUI's process)."""

    def served(self):
        """(rank 0's pid, its model calls so far), or None when no world is up."""
        try:
            workers = self.get("/hybrid_parallel/pool").get("workers") or []
        except Exception:  # noqa: BLE001 - a server without the pack's routes
            return None
        w0 = next((w for w in workers if w.get("rank") == 0 and "model_calls" in w), None)
        return None if w0 is None else (w0.get("pid"), int(w0["model_calls"]))

    def run(self, graph: dict, timeout_s: float = 600.0) -> dict:
        before = self.served()
        entry = super().run(graph, timeout_s)
        after = self.served()
        if after is None:
            calls = 0 if before is None else None  # no world now: none served (or it went down: unknown)
        else:
            calls = after[1] - before[1] if before is not None and before[0] == after[0] else after[1]
        entry["_hp_model_calls"] = calls
        entry["_hp_prompt"] = graph
        return entry


def _pool_sampling(entry) -> bool | None:
    """Whether the prompt sampled through the pack's nodes: a Hybrid Sampler, or a sampler node downstream of a
    Parallel Model, that ComfyUI executed (not served from its cache). None: the prompt is not known."""
    prompt = entry.get("_hp_prompt")
    if prompt is None:
        return None
    cached = set()
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_cached":
            cached |= {str(n) for n in data.get("nodes", [])}

    def upstream(nid, seen):
        for v in (prompt.get(nid) or {}).get("inputs", {}).values():
            if isinstance(v, list) and len(v) == 2 and str(v[0]) not in seen:
                seen.add(str(v[0]))
                upstream(str(v[0]), seen)
        return seen
    for nid, node in prompt.items():
        if str(nid) in cached or node.get("class_type") not in SAMPLERS:
            continue
        if node["class_type"] == "HybridSampler" or any(
                (prompt.get(u) or {}).get("class_type") == "HybridParallelModel" for u in upstream(str(nid), set())):
            return True
    return False


def assert_ok(server, entry) -> None:
    assert "rejected" not in entry, entry
    assert entry["status"]["status_str"] == "success", (entry["status"], server.tail())
    sampled, calls = _pool_sampling(entry), entry.get("_hp_model_calls")
    if sampled and calls is not None:
        assert calls > 0, "the prompt sampled through the pack's nodes, but the workers served no model call"
    elif sampled is False and not any((n or {}).get("class_type") in POOL_NODES
                                      for n in (entry.get("_hp_prompt") or {}).values()):
        assert not calls, f"a prompt without the pack's nodes had the workers serve {calls} model calls"


def error_text(entry) -> str:
    """The execution error messages of a failed prompt's history entry."""
    return " ".join(m[1].get("exception_message", "") for m in entry["status"]["messages"] if m[0] == "execution_error")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def latent(server, tag):
    """The latent a workflow saved as lat_<tag> (HPSaveLatentTensor)."""
    from safetensors.torch import load_file
    return load_file(str(server.output(f"lat_{tag}.safetensors")))["images"]


def tiny_unet(server, name: str, module: str, write) -> str:
    """The tiny diffusion model `name` in the server's models folder, written by `write(path)` when absent; the calling
    test is skipped where this ComfyUI has no `module` (a family a later ComfyUI added)."""
    import importlib

    import pytest
    try:
        importlib.import_module(module)
    except ImportError:
        pytest.skip(f"this ComfyUI has no {module} (a later ComfyUI's family)")
    path = server.base / "models" / "diffusion_models" / name
    if not path.exists():
        write(path)
    return name


# A family's server matrix is proven once in CI, on one world: its sequence plan through both sequence methods at
# once (u2r2; else the one sequence case it has) and its batch split composed with it (cfg2 x u2), plus any case of its
# own (tp, pp, its references) - an own case that splits the sequence over ulysses 2 alone (DistriFusion's) composed
# with cfg 2 as well. Ulysses and ring alone, cfg alone and sharded weights are the same mechanism on every family,
# proven family-independently in CI (tests/engine/test_usp.py, tests/engine/test_shard.py,
# tests/families/test_native_pool.py, tests/server_e2e/test_comfyui_any_model.py): the rest of a family's matrix runs
# with the slow set (`part` "rest"). Why one world: on 2 cores a prompt on a running world costs ~0.5 s and a world
# switch 5-11 s (interpreters, torch and ComfyUI imports, gloo); u2r2 and cfg2 x u2 are the same 4-rank world, so a
# family's CI cases - and the next family's - run on the world the one before left running.
STANDARD = ("u2", "r2", "u2r2", "cfg2", "u2_sharded")
PARTS = ["ci", pytest.param("rest", marks=pytest.mark.slow)]


def one_world(cases) -> list:
    """The cases of `cases` that prove its sequence plan and its batch split on one 4-rank world: u2r2 (else the one
    sequence case) and cfg2 composed with ulysses 2 (cfg2 alone where the sequence case is not u2r2)."""
    names = [c[0] for c in cases]
    seq = next((n for n in ("u2r2", "u2", "r2") if n in names), None)
    out = [c for c in cases if c[0] == seq]
    cfg = next((c for c in cases if c[0] == "cfg2"), None)
    if cfg is not None:
        out.append(("cfg2u2", {**cfg[1], "ulysses_degree": 2}, cfg[2]) if seq == "u2r2" else cfg)
    return out


def _on_the_world(case, four: bool):
    """An own case on ulysses 2 alone, composed with cfg 2 where the family's other CI cases run on 4 ranks."""
    name, degrees, node = case
    sizes = {k: v for k, v in degrees.items() if k.endswith("_degree") and v > 1}
    if four and sizes == {"ulysses_degree": 2}:
        return (f"{name}_cfg2", {**degrees, "cfg_degree": 2}, "sampler")
    return case


def part_of(cases, part: str) -> list:
    """The cases of `cases` in `part` ("ci" or "rest", see PARTS)."""
    base = one_world(cases)
    four = any(c[0] in ("u2r2", "cfg2u2") for c in base)
    own = [c for c in cases if c[0] not in STANDARD]
    ci = base + [_on_the_world(c, four) for c in own]
    chosen = ci if part == "ci" else [c for c in cases if c not in ci]
    assert chosen, f"no {part} case in {[c[0] for c in cases]}: parametrize this test without PARTS"
    return chosen


def assert_loaded_whole(server) -> None:
    """No model the server loaded since the last look lacked weights its class has ("unet missing: [...]" in its
    log): ComfyUI's load is not strict, so a tiny file that misses layers of the class ComfyUI's detection builds
    leaves them uninitialised memory, which KSampler and the workers compute with alike - a reference that proves
    nothing, or NaN once the allocator reuses memory (ERNIE-Image's test did, 2026-11-30)."""
    with open(server.base / "comfyui.log", errors="replace") as f:
        f.seek(getattr(server, "_log_checked", 0))
        new = f.read()
        server._log_checked = f.tell()
    missing = [line[:300] for line in new.splitlines() if "unet missing:" in line]
    assert not missing, f"a tiny file lacks weights of the class ComfyUI built (write its sizes): {missing}"


def equal_ksampler(server, graph, tag: str, cases, bound: float = 1e-5):
    """KSampler's latent for `graph(tag)`, then each case `(name, degrees, node)` of `graph(tag_name, degrees, node)`
    on the pool, within `bound` of it (fp8 and bf16 weights compute in fp32 on CPU: the exact bound). Returns
    KSampler's latent."""
    assert_ok(server, server.run(graph(f"{tag}_ref")))
    assert_loaded_whole(server)
    ref = latent(server, f"{tag}_ref")
    for name, degrees, node in cases:
        assert_ok(server, server.run(graph(f"{tag}_{name}", degrees, node)))
        err = rel(latent(server, f"{tag}_{name}"), ref)
        print(f"{tag} {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= bound, (tag, name, err)
    return ref


def distrifusion_sync_and_stale(server, graph, tag: str, steps: int, bound: float = 0.5) -> float:
    """DistriFusion at ulysses 2 with the cfg batch split (cfg 2: the family cases' 4-rank world) through Hybrid Sampler
    on `graph`: every step synchronous (warmup = steps) within the exact bound of KSampler, then one warmup step - the
    stale error, printed and returned (measured: above 0, below `bound`)."""
    df = {"ulysses_degree": 2, "cfg_degree": 2, "method": "distrifusion"}
    ref = equal_ksampler(server, graph, tag, [("sync", {**df, "warmup_steps": steps}, "sampler")])
    assert_ok(server, server.run(graph(f"{tag}_stale", {**df, "warmup_steps": 1}, "sampler")))
    err = rel(latent(server, f"{tag}_stale"), ref)
    print(f"{tag}: DistriFusion with one warmup step of {steps}: {err:.2e} from KSampler (random tiny weights)")
    assert 0.0 < err < bound, err
    return err


def workflow(degrees, tag: str, width: int, height: int, steps: int = 3, cfg: float = 4.0,
             sampler: str = "euler", scheduler: str = "normal", batch: int = 1, png: bool = False,
             family: str = "sd3", length: int = 5, lora: tuple = None, denoise: float = 1.0,
             mask: bool = False, weight_dtype: str = "default") -> dict:
    """API prompt on a family's tiny checkpoints: KSampler -> VAEDecode when `degrees` is None, else
    Parallel Config(degrees) -> Hybrid Sampler -> Parallel VAE Decode; the image and the latent are saved
    losslessly as output/img_<tag> and output/lat_<tag> (and as a PNG when `png`). `lora`: (file, strength)
    applied to the MODEL with LoraLoaderModelOnly. `mask`: a noise mask (SetLatentNoiseMask) that keeps the
    top-left quarter of the latent and denoises the rest. `weight_dtype`: UNETLoader's (fp8_e4m3fn, ...)."""
    f = FAMILIES[family]

    def cond(seed):
        return {"class_type": "HPExampleConditioning", "inputs": {
            "seed": seed, "tokens": f["tokens"], "context_dim": f["context_dim"], "pooled_dim": f["pooled_dim"],
            "guidance": f.get("guidance", -1.0)}}
    latent = {"width": width, "height": height, "batch_size": batch}
    if family in ("wan", "hunyuan_video15", "ltxv", "ltxav", "kandinsky5", "cogvideox"):
        latent["length"] = length
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": f["unet"], "weight_dtype": weight_dtype}},
        "2": cond(1), "3": cond(2),
        "4": {"class_type": f["latent"], "inputs": latent},
        "6": {"class_type": "VAELoader", "inputs": {"vae_name": f["vae"]}},
    }
    model = ["1", 0]
    latent_image = ["4", 0]
    if mask:
        g["20"] = {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": width, "height": height}}
        g["21"] = {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": width // 2, "height": height // 2}}
        g["22"] = {"class_type": "MaskComposite", "inputs": {"destination": ["20", 0], "source": ["21", 0],
                                                             "x": 0, "y": 0, "operation": "multiply"}}
        g["23"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["4", 0], "mask": ["22", 0]}}
        latent_image = ["23", 0]
    if lora is not None:
        g["12"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora[0],
                                                                   "strength_model": lora[1]}}
        model = ["12", 0]
    common = {"model": model, "seed": 42, "steps": steps, "cfg": cfg, "sampler_name": sampler,
              "scheduler": scheduler, "positive": ["2", 0], "negative": ["3", 0], "latent_image": latent_image,
              "denoise": denoise}
    return sample_decode_save(g, common, degrees, tag, png)


def third_party() -> list:
    """The other packs' folders the session's server loads: real packs given by hand (what scripts/setup_thirdparty.sh
    unpacked into the venv from HP_THIRDPARTY_DIR, a ComfyUI-GGUF checkout named by HP_COMFYUI_GGUF), and the tests'
    stand-ins of the packs' mechanisms (tests/standins: CI's) for every pack not given for real."""
    from comfyui_hybrid_parallel.workers.bridge.origin import pack_name
    found = {p.name: p for p in sorted((Path(sys.prefix) / "thirdparty").glob("*")) if (p / "__init__.py").is_file()}
    if os.environ.get("HP_COMFYUI_GGUF"):
        found["ComfyUI-GGUF"] = Path(os.environ["HP_COMFYUI_GGUF"])
    real = {pack_name(name) for name in found}
    for stand_in in sorted((Path(__file__).parent / "standins").glob("*")):
        if (stand_in / "__init__.py").is_file() and pack_name(stand_in.name) not in real:
            found[stand_in.name] = stand_in
    return list(found.values())
