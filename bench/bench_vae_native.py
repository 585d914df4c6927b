"""Per-rank peak memory of Patch VAE Decode on ComfyUI's own VAEs, side by side with VAE Decode and VAE Decode (Tiled).

Each rank of a gloo world (tests/dist_harness.DistPool, 2 and 4 CPU processes) imports ComfyUI, builds the VAE with
ComfyUI's own detection (comfy.sd.VAE from a state dict in ComfyUI's format, random weights, the real layout) and
decodes one latent: rank 0 first serially as VAE Decode does (first_stage_model.decode) and tiled as VAE Decode
(Tiled) does with 256-pixel tiles, 64 overlap (VAE.decode_tiled), then every rank its band of rows (parallel/vae/native.py, the
node's decode without the final gather). Memory is the bytes of live tensor storages created inside the decode
(live_bytes.LiveBytes: activations; the weights and the input latent are not counted) - on CUDA it would be
torch.cuda.max_memory_allocated. Times are recorded with N processes sharing this machine's cores: not a speed result.

    python bench/bench_vae_native.py [--quick]

Prints a Markdown table and writes bench/results/vae_native.json (vae_native_quick.json with --quick).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

# name: (writer, its kwargs, latent shape, quick latent shape)
MODELS = {
    "KL (SD layout, 4 ch)": ("write_kl_vae", dict(style="sd"), (1, 4, 48, 48), (1, 4, 24, 20)),
    "Wan 2.1 (dim 32)": ("write_wan_vae", dict(dim=32), (1, 16, 3, 30, 40), (1, 16, 2, 12, 16)),
    "HunyuanVideo 1.0 (real layout)": ("write_hunyuan_video_vae", {}, (1, 16, 2, 16, 16), (1, 16, 2, 8, 8)),
}


def _measure(fn):
    from live_bytes import LiveBytes
    mode = LiveBytes()
    t0 = time.perf_counter()
    with mode, torch.no_grad():
        out = fn()
    return out, mode.peak, time.perf_counter() - t0


TILE, OVERLAP, TEMPORAL, TEMPORAL_OVERLAP = 256, 64, 64, 8  # VAE Decode (Tiled)'s widgets (its default tile is 512)


def _decode_tiled(vae, latent):
    """What ComfyUI's VAEDecodeTiled node runs with the widgets above (pixel sizes turned into latent sizes)."""
    c = vae.spacial_compression_decode()
    t_c = vae.temporal_compression_decode()
    t_size = t_overlap = None
    if t_c is not None:
        t_size = max(2, TEMPORAL // t_c)
        t_overlap = max(1, min(t_size // 2, TEMPORAL_OVERLAP // t_c))
    return vae.decode_tiled(latent, tile_x=TILE // c, tile_y=TILE // c, overlap=OVERLAP // c, tile_t=t_size,
                            overlap_t=t_overlap)


def _body(n, name, path, shape):
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.sd
    import comfy.utils

    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.vae import world_axis
    from comfyui_hybrid_parallel.parallel.vae.comfy_vaes import comfy_vae_for
    from comfyui_hybrid_parallel.parallel.vae.native import native_patch_decode
    from dist_harness import context_for
    torch.set_num_threads(1)
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(path))
    model = vae.first_stage_model
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    res = {}
    if ax.rank == 0:
        serial, res["serial_peak"], res["serial_s"] = _measure(lambda: model.decode(latent))
        _, res["tiled_peak"], res["tiled_s"] = _measure(lambda: _decode_tiled(vae, latent))
        res["out_shape"] = list(serial.shape)
    torch.distributed.barrier()
    (rows, first), res["patch_peak"], res["patch_s"] = _measure(
        lambda: native_patch_decode(model, comfy_vae_for(model), latent, ax, gather=False))
    if ax.rank == 0:
        res["rel_err_rows"] = float((rows - serial.narrow(-2, first, rows.shape[-2])).norm()
                                    / serial.narrow(-2, first, rows.shape[-2]).norm())
    return res


def main():
    from _worlds import write_results
    from comfy_env import setup_comfy
    from dist_harness import DistPool
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worlds", default="2,4")
    args = ap.parse_args()
    setup_comfy()
    import tempfile

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    tmp = Path(tempfile.mkdtemp(prefix="hp_bench_vae_native_"))
    rows, lines = [], ["| VAE | latent | ranks | VAE Decode peak | VAE Decode (Tiled) peak | Patch VAE Decode peak per "
                       "rank (max) | vs VAE Decode | rows rel. err |", "|---|---|---|---|---|---|---|---|"]
    for name, (writer, kw, shape, quick) in MODELS.items():
        path = tmp / f"{writer}.safetensors"
        getattr(tc, writer)(path, seed=3, **kw)
        shape = quick if args.quick else shape
        for n in (int(w) for w in args.worlds.split(",")):
            pool = DistPool(n, collective_timeout_s=3600.0)  # rank 0 decodes serially and tiled first
            try:
                per_rank = pool.run(_body, n, name, str(path), shape, timeout=1800)
            finally:
                pool.close()
            r0 = per_rank[0]
            peak = max(r["patch_peak"] for r in per_rank)
            row = {"vae": name, "latent": list(shape), "ranks": n, "serial_peak": r0["serial_peak"],
                   "tiled_peak": r0["tiled_peak"], "patch_peak_max": peak,
                   "patch_peaks": [r["patch_peak"] for r in per_rank], "serial_s": r0["serial_s"],
                   "tiled_s": r0["tiled_s"], "patch_s": max(r["patch_s"] for r in per_rank),
                   "rel_err_rows": r0["rel_err_rows"], "out_shape": r0["out_shape"]}
            rows.append(row)
            mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
            lines.append(f"| {name} | {tuple(shape)} | {n} | {mib(row['serial_peak'])} | {mib(row['tiled_peak'])} | "
                         f"{mib(peak)} | {peak / row['serial_peak']:.2f}x | {row['rel_err_rows']:.1e} |")
            print(lines[-1], flush=True)
    write_results("vae_native_quick" if args.quick else "vae_native", rows, "\n".join(lines),
                  extra={"quick": args.quick})


if __name__ == "__main__":
    main()
