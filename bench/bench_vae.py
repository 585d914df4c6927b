"""Peak activation memory and halo traffic of patch-parallel VAE decode versus serial.

Runs its own gloo worlds of 2 and 4 CPU processes (tests/dist_harness.DistPool)
and decodes one latent with a random diffusers AutoencoderKL (SD-like layout,
narrower channels) and a random Wan 2.1 VAE (real layout, narrow base width):
serially on one rank, then patch-parallel on every rank, with and without
`block_size`. Memory is counted with a TorchDispatchMode that tracks the bytes
of live tensor storages created inside the decode (weights and the input latent
are not counted), i.e. activation memory; on CUDA it would be
torch.cuda.max_memory_allocated. "decode peak" excludes the final all-gather of
the image (gather=False); "with gather" includes it (every rank then also holds
the full image). Expect the decode peak to fall to about 1/N of serial.
Times are taken under the memory counter (Python work per aten op) with N
processes sharing this machine's cores: they are recorded, not a speed result.

    /work/venv/bin/python bench/bench_vae.py [--quick]

Prints a Markdown table and writes bench/results/vae.json (vae_quick.json with --quick).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import weakref
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages allocated inside the mode and still alive (refcounted by storage)."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = t.untyped_storage()
                key = st.data_ptr()
            except RuntimeError:  # a wrapper subclass (DTensor): its local tensor was counted when made
                continue
            if key == 0:
                continue
            if key in self.live:
                self.live[key][1] += 1
            else:
                self.live[key] = [st.nbytes(), 1]
                self.current += st.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, key)
        return out


MODELS = {
    # name: (constructor kwargs, latent shape)
    "AutoencoderKL": (dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 64, 64, 64),
                           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                           layers_per_block=2, norm_num_groups=16), (1, 16, 48, 40)),
    "AutoencoderKLWan": (dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                              temperal_downsample=[False, True, True]), (1, 16, 3, 24, 32)),
}
QUICK = {"AutoencoderKL": (1, 16, 24, 20), "AutoencoderKLWan": (1, 16, 2, 12, 16)}


def _build(name):
    from diffusers import AutoencoderKL, AutoencoderKLWan

    torch.manual_seed(0)
    cls = AutoencoderKL if name == "AutoencoderKL" else AutoencoderKLWan
    return cls(**MODELS[name][0]).eval()


def _measure(fn):
    mode = LiveBytes()
    t0 = time.perf_counter()
    with mode:
        out = fn()
    return out, mode.peak, time.perf_counter() - t0


def _body(n, name, shape, block_size, run_serial):
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.vae import patch_decode, world_axis
    from dist_harness import context_for

    torch.set_num_threads(1)
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    vae = _build(name)
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    res = {}
    if run_serial and ax.rank == 0:
        with torch.no_grad():
            serial, res["serial_peak"], res["serial_s"] = _measure(lambda: vae.decode(latent).sample)
        res["out_shape"] = list(serial.shape)
    if ax.size > 1:
        torch.distributed.barrier()  # the other ranks wait for rank 0's serial decode here, not inside the timing
    ctx.stats.reset()
    _, res["decode_peak"], res["decode_s"] = _measure(
        lambda: patch_decode(vae, latent, ax, block_size=block_size, gather=False))
    res["stats"] = ctx.stats.snapshot()
    ctx.stats.reset()
    full, res["gather_peak"], res["total_s"] = _measure(lambda: patch_decode(vae, latent, ax, block_size=block_size))
    if run_serial and ax.rank == 0:
        res["rel_err"] = float((full - serial).norm() / serial.norm())
    return res


def main():
    from dist_harness import DistPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small latents (smoke run)")
    ap.add_argument("--worlds", default="2,4")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for n in [int(v) for v in args.worlds.split(",")]:
        pool = DistPool(n, collective_timeout_s=600)
        try:
            for name in MODELS:
                shape = QUICK[name] if args.quick else MODELS[name][1]
                block = 8 if name == "AutoencoderKL" else 16
                for bs in (None, block):
                    res = pool.run(_body, n, name, shape, bs, True, timeout=1200)
                    r0 = res[0]
                    row = {
                        "model": name, "latent": list(shape), "output": r0["out_shape"], "ranks": n,
                        "block_size": bs, "serial_peak_MiB": r0["serial_peak"] / 2**20,
                        "decode_peak_MiB_per_rank": [r["decode_peak"] / 2**20 for r in res],
                        "with_gather_peak_MiB_per_rank": [r["gather_peak"] / 2**20 for r in res],
                        "halo_bytes_per_rank": [r["stats"].get("halo", {}).get("bytes", 0) for r in res],
                        "halo_calls_per_rank": [r["stats"].get("halo", {}).get("calls", 0) for r in res],
                        "kv_gather_bytes_per_rank": [r["stats"].get("all_gather", {}).get("bytes", 0) for r in res],
                        "serial_s": r0["serial_s"], "decode_s_per_rank": [r["decode_s"] for r in res],
                        "rel_err": r0["rel_err"],
                    }
                    row["peak_ratio"] = max(row["decode_peak_MiB_per_rank"]) / row["serial_peak_MiB"]
                    rows.append(row)
                    print(f"done {name} n={n} block_size={bs}", file=sys.stderr, flush=True)
        finally:
            pool.close()
    md = ["| model | latent -> output | ranks | block_size | serial peak MiB | decode peak MiB/rank (max) "
          "| ratio | with gather MiB (max) | halo KiB/rank (max) | K/V+stats gather KiB/rank | rel err |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {tuple(r['latent'])} -> {tuple(r['output'])} | {r['ranks']} | {r['block_size']} "
                  f"| {r['serial_peak_MiB']:.1f} | {max(r['decode_peak_MiB_per_rank']):.1f} | {r['peak_ratio']:.2f} "
                  f"| {max(r['with_gather_peak_MiB_per_rank']):.1f} | {max(r['halo_bytes_per_rank']) / 1024:.0f} "
                  f"| {max(r['kv_gather_bytes_per_rank']) / 1024:.0f} | {r['rel_err']:.1e} |")
    from _worlds import write_results
    write_results("vae_quick" if args.quick else "vae", rows, "\n".join(md),
                  {"quick": args.quick,
                   "memory": "peak bytes of live tensor storages created during the decode (TorchDispatchMode)"})

if __name__ == "__main__":
    main()
