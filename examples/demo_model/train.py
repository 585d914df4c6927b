"""Train the demo model from nothing on this machine: VAE, diffusion model and checker, fixed seeds.

    .venv/bin/python examples/demo_model/train.py            # ~26 min on 2 cores; writes weights/
    .venv/bin/python examples/demo_model/train.py --quick    # a minute: the same code on tiny step counts

1. VAE (ComfyUI's TAESD class, 16 channels): its encoder is set to a colour mosaic (nets.build_vae says why),
   its decoder learns to draw the picture back (pictures drawn at 32 px, then 64 px); then its scale and shift
   (ComfyUI's TAESD applies them around encoder and decoder) are set so its latents, after SD3's latent scale
   and shift, have mean 0 and variance 1 (the decode is unchanged).
2. Diffusion model (ComfyUI's MMDiT, depth 3): rectified flow on those latents exactly as ComfyUI samples an
   SD3 model (timestep = 1000 sigma, shift 3, v = noise - x0), text.py's conditioning, captions dropped
   10 % of the time for CFG, EMA weights.
3. Classifier: names shape, colour and background of a picture (the automatic check of the tests).
4. Check: samples the eight test captions (shapes.TEST_SCENES) with the trained model here (Euler, 20 steps,
   CFG 4), decodes and classifies them; writes every number to weights/train_log.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SHIFT = 3.0  # SD3's sampling shift (ComfyUI's supported_models.SD3)
SD3_SCALE, SD3_SHIFT = 1.5305, 0.0609  # comfy.latent_formats.SD3


def sigma_of(t: torch.Tensor) -> torch.Tensor:
    return SHIFT * t / (1 + (SHIFT - 1) * t)


def cosine_lr(step: int, total: int, peak: float, warmup: int = 100, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def train_vae(vae, small: torch.Tensor, pool: torch.Tensor, steps: int, steps_full: int, log: dict) -> None:
    """The decoder, from the encoder's colour mosaic back to the picture (in [0, 1], TAESD's own ranges): first on
    whole pictures drawn at 32 px (4x cheaper), then at 64 px; a little noise on the latent so it tolerates a
    sampler's imperfect latents; the shape's pixels weighted up (it covers ~10 % of a picture)."""
    dec = vae.taesd_decoder
    opt = torch.optim.AdamW(dec.parameters(), lr=5e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps + steps_full):
        src, n = (pool, 8) if step >= steps else (small, 16)
        x = src[torch.randint(len(src), (n,), generator=g)]
        if torch.rand(1, generator=g).item() < 0.5:
            x = x.flip(3)
        for grp in opt.param_groups:
            grp["lr"] = cosine_lr(step, steps + steps_full, 5e-4, warmup=50)
        with torch.no_grad():
            z = vae.taesd_encoder(x)
        y = dec(z + 0.05 * torch.randn(z.shape, generator=g))
        w = 1 + 8 * ((x - x[:, :, :1, :1]).abs().sum(1, keepdim=True) > 0.15).float()  # corner: background
        err = y - x
        loss = (w * (2 * err.abs() + 4 * err.pow(2))).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 200 == 0 or step == steps + steps_full - 1:
            print(f"  vae decoder step {step:5d}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True)
    log["vae_loss_last50"] = sum(losses[-50:]) / len(losses[-50:])


@torch.no_grad()
def encode(vae, images: torch.Tensor) -> torch.Tensor:
    """ComfyUI's TAESD.encode (pictures in [0, 1] -> raw latents), its encoder computed as the plain-torch
    nets.mosaic it is set to (tests/server_e2e/test_demo_model.py asserts they are equal): ~100x cheaper than running the
    encoder's full-resolution convolutions, which took 3 of the script's minutes."""
    from demo_model import nets
    return nets.mosaic(images) / vae.vae_scale + vae.vae_shift


@torch.no_grad()
def decode(vae, latents: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """ComfyUI's TAESD.decode (raw latents -> pictures in [0, 1])."""
    return torch.cat([((vae.decode(latents[i:i + chunk]) + 1) / 2).clamp(0, 1)
                      for i in range(0, len(latents), chunk)])


@torch.no_grad()
def normalise_latents(vae, images: torch.Tensor, log: dict) -> None:
    """Set TAESD's vae_scale / vae_shift so SD3's process_in of a raw latent, (r - SHIFT) * SCALE, has mean 0
    and std 1; decode(encode(x)) is unchanged (the decoder sees the same tensor)."""
    from demo_model import nets
    z = nets.mosaic(images)  # what the encoder computes (see encode)
    m, s = z.mean().item(), z.std().item()
    vae.vae_scale.fill_(s * SD3_SCALE)
    vae.vae_shift.fill_(SD3_SHIFT - m / (s * SD3_SCALE))
    log["encoder_mean_std"] = [m, s]
    log["latent_channel_std"] = [round(v, 3) for v in ((z - m) / s).std(dim=(0, 2, 3)).tolist()]


def train_dit(dit, latents, contexts, pooled, empty, steps: int, log: dict, batch: int = 64):
    import copy

    ema = copy.deepcopy(dit).requires_grad_(False)
    params = [p for p in dit.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(2)
    losses = []
    for step in range(steps):
        idx = torch.randint(len(latents), (batch,), generator=g)
        x0 = latents[idx]
        ctx, pool = contexts[idx].clone(), pooled[idx].clone()
        drop = torch.rand(batch, generator=g) < 0.1
        ctx[drop], pool[drop] = empty[0], empty[1]
        t = torch.rand(batch, generator=g)
        sigma = sigma_of(t).view(-1, 1, 1, 1)
        noise = torch.randn(x0.shape, generator=g)
        xt = (1 - sigma) * x0 + sigma * noise
        for grp in opt.param_groups:
            grp["lr"] = cosine_lr(step, steps, 5e-4, warmup=200)
        v = dit(xt, sigma.flatten() * 1000, context=ctx, y=pool)
        loss = F.mse_loss(v, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), dit.parameters()):
                pe.lerp_(pm, 1 - decay)
        losses.append(loss.item())
        if step % 250 == 0 or step == steps - 1:
            print(f"  dit step {step:5d}  loss {sum(losses[-100:]) / len(losses[-100:]):.4f}", flush=True)
    log["dit_loss_last100"] = sum(losses[-100:]) / len(losses[-100:])
    return ema


def train_classifier(clf, images, labels, steps: int, batch: int = 64) -> None:
    opt = torch.optim.AdamW(clf.parameters(), lr=1e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        idx = torch.randint(len(images), (batch,), generator=g)
        x = images[idx]
        x = (x + 0.04 * torch.randn(x.shape, generator=g)).clamp(0, 1)  # robust to a little sampling noise
        for grp in opt.param_groups:
            grp["lr"] = cosine_lr(step, steps, 1e-3, warmup=50)
        out = clf(x)
        loss = sum(F.cross_entropy(o, labels[idx, i]) for i, o in enumerate(out))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"  classifier step {step:5d}  loss {loss.item():.4f}", flush=True)


@torch.no_grad()
def accuracy(clf, images, scenes) -> float:
    preds = torch.stack([o.argmax(1) for o in clf(images)], dim=1)
    want = torch.tensor([s.labels() for s in scenes])
    return (preds == want).all(dim=1).float().mean().item(), preds


@torch.no_grad()
def sample(dit, context, pooled, empty, seed: int, steps: int = 20, cfg: float = 4.0, size: int = 8):
    """Euler on the flow as ComfyUI's euler sampler with the 'simple' sigmas would do (an in-script check)."""
    n = len(context)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, size, size, generator=g)
    sig = sigma_of(torch.linspace(1, 0, steps + 1))
    ctx = torch.cat([context, empty[0].expand(n, -1, -1)])
    pool = torch.cat([pooled, empty[1].expand(n, -1)])
    for i in range(steps):
        v_c, v_u = dit(torch.cat([x, x]), (sig[i] * 1000).expand(2 * n), context=ctx, y=pool).chunk(2)
        x = x + (sig[i + 1] - sig[i]) * (v_u + cfg * (v_c - v_u))
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "weights"))
    ap.add_argument("--vae-steps", type=int, default=1200)
    ap.add_argument("--vae-full-steps", type=int, default=150)
    ap.add_argument("--dit-steps", type=int, default=6000)
    ap.add_argument("--dit-images", type=int, default=8000)
    ap.add_argument("--cls-steps", type=int, default=2500)
    ap.add_argument("--quick", action="store_true", help="tiny step counts (checks the script, not the model)")
    args = ap.parse_args()
    if args.quick:
        args.vae_steps, args.vae_full_steps, args.dit_steps, args.dit_images, args.cls_steps = 20, 5, 30, 512, 30

    from comfyui_hybrid_parallel.doctor.machine import find_comfyui, import_comfyui
    comfy_dir = find_comfyui()
    if comfy_dir is None:
        sys.exit("ComfyUI is not installed: run `bash scripts/setup_comfyui.sh .venv` (or set COMFYUI_DIR)")
    import_comfyui(comfy_dir, cpu=True)
    from safetensors.torch import save_file

    from demo_model import CLASSIFIER_FILE, DIT_FILE, VAE_FILE, nets, shapes
    from hp_example_nodes import demo_text as text

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = {"args": vars(args), "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
           "torch": torch.__version__, "seconds": {}}
    t_all = time.perf_counter()
    rng = random.Random(0)

    t = time.perf_counter()
    images, scenes = shapes.batch(args.dit_images, rng)
    log["seconds"]["render"] = time.perf_counter() - t
    print(f"rendered {len(images)} pictures in {log['seconds']['render']:.1f} s", flush=True)

    t = time.perf_counter()
    vae = nets.build_vae()
    small, _ = shapes.batch(4000, random.Random(1), size=32)
    train_vae(vae, small, images, args.vae_steps, args.vae_full_steps, log)
    normalise_latents(vae, images[:2048], log)
    log["seconds"]["vae"] = time.perf_counter() - t

    t = time.perf_counter()
    latents = (encode(vae, images) - SD3_SHIFT) * SD3_SCALE  # what the model sees (SD3 process_in)
    recon = decode(vae, latents[:256] / SD3_SCALE + SD3_SHIFT)
    log["vae_recon_psnr"] = (10 * torch.log10(1 / F.mse_loss(recon, images[:256]))).item()
    log["latent_std"] = latents.std().item()
    log["seconds"]["encode"] = time.perf_counter() - t
    print(f"latents {tuple(latents.shape)} std {log['latent_std']:.3f}; VAE PSNR {log['vae_recon_psnr']:.1f} dB",
          flush=True)

    encs = {}
    for s in set(scenes):
        encs[s] = text.encode(s.caption)
    contexts = torch.cat([encs[s][0] for s in scenes])
    pooled = torch.cat([encs[s][1] for s in scenes])
    empty = text.encode("")

    t = time.perf_counter()
    dit = nets.build_dit()
    ema = train_dit(dit, latents, contexts, pooled, empty, args.dit_steps, log)
    log["seconds"]["dit"] = time.perf_counter() - t

    t = time.perf_counter()
    labels = torch.tensor([s.labels() for s in scenes])
    n_rec = min(2000, len(images))  # also pictures as the VAE draws them back (what it will see in the checks)
    drawn = decode(vae, latents[:n_rec] / SD3_SCALE + SD3_SHIFT + 0.05 * torch.randn(latents[:n_rec].shape))
    clf = nets.new_classifier()
    train_classifier(clf, torch.cat([images, drawn]), torch.cat([labels, labels[:n_rec]]), args.cls_steps)
    clf.eval()
    log["classifier_acc_clean_unseen"] = accuracy(clf, *shapes.batch(256, random.Random(99)))[0]
    log["classifier_acc_recon"] = accuracy(clf, recon, scenes[:256])[0]
    log["seconds"]["classifier"] = time.perf_counter() - t

    t = time.perf_counter()
    tests = list(shapes.TEST_SCENES) * 4
    encoded = [text.encode(s.caption) for s in tests]
    ctx = torch.cat([c for c, _ in encoded])
    pool = torch.cat([p for _, p in encoded])
    ema.eval()
    lat = sample(ema, ctx, pool, empty, seed=123)
    pics = decode(vae, lat / SD3_SCALE + SD3_SHIFT)
    acc, preds = accuracy(clf, pics, tests)
    log["sample_acc_test_captions_x4"] = acc
    log["seconds"]["check"] = time.perf_counter() - t
    log["seconds"]["total"] = time.perf_counter() - t_all
    print(f"classifier on unseen pictures: {log['classifier_acc_clean_unseen']:.3f}, on VAE reconstructions: "
          f"{log['classifier_acc_recon']:.3f}; on the model's samples of the "
          f"8 test captions x 4 seeds: {acc:.3f}", flush=True)

    meta = {"format": "pt", "hp_demo_model": "trained by examples/demo_model/train.py"}
    save_file({k: v.to(torch.float16).contiguous() for k, v in ema.state_dict().items()}, str(out / DIT_FILE), meta)
    save_file({k: v.to(torch.float16).contiguous() for k, v in vae.state_dict().items()}, str(out / VAE_FILE), meta)
    save_file({k: v.contiguous() for k, v in clf.state_dict().items()}, str(out / CLASSIFIER_FILE), meta)
    _save_grid(pics, out / "train_samples.png", cols=8)
    (out / "train_log.json").write_text(json.dumps(log, indent=1, default=str) + "\n")
    print(f"wrote {out} in {log['seconds']['total'] / 60:.1f} min", flush=True)


def _save_grid(pics: torch.Tensor, path: Path, cols: int) -> None:
    from PIL import Image
    n, _, h, w = pics.shape
    rows = (n + cols - 1) // cols
    grid = torch.ones(3, rows * (h + 2), cols * (w + 2))
    for i, p in enumerate(pics):
        r, c = divmod(i, cols)
        grid[:, r * (h + 2):r * (h + 2) + h, c * (w + 2):c * (w + 2) + w] = p
    arr = (grid.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(arr).save(path)


if __name__ == "__main__":
    main()
