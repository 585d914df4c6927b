"""Train the demo model from nothing on this machine: VAE, diffusion model and checker, fixed seeds.

    .venv/bin/python examples/demo_model/train.py            # ~25 min on 2 cores; writes weights/
    .venv/bin/python examples/demo_model/train.py --quick    # a minute: the same code on tiny step counts

1. VAE (ComfyUI's Wan 2.1 class, width 16): reconstruct pictures of shapes.py (crops of 32 px, then whole
   64 px pictures), then fold a per-channel affine into its 1x1 in/out convolutions so its latents, after
   SD3's latent scale and shift, are zero-mean and unit-variance per channel (the decode is unchanged).
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


def train_vae(vae, pool: torch.Tensor, steps: int, steps_full: int, log: dict) -> None:
    from demo_model.nets import frame_convs

    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    losses = []
    with frame_convs():
        for step in range(steps + steps_full):
            full = step >= steps
            n, crop = (16, 64) if full else (32, 32)
            idx = torch.randint(len(pool), (n,), generator=g)
            x = pool[idx]
            if not full:
                oy, ox = torch.randint(0, 64 - crop + 1, (2,), generator=g).tolist()
                x = x[:, :, oy:oy + crop, ox:ox + crop]
            if torch.rand(1, generator=g).item() < 0.5:
                x = x.flip(3)
            x = (x * 2 - 1).unsqueeze(2)
            for grp in opt.param_groups:
                grp["lr"] = cosine_lr(step, steps + steps_full, 1e-3)
            z = vae.encode(x)
            zn = z + 0.1 * z.detach().std() * torch.randn(z.shape, generator=g)
            y = vae.decode(zn)
            loss = F.l1_loss(y, x) + F.mse_loss(y, x) + 1e-4 * z.pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % 100 == 0 or step == steps + steps_full - 1:
                print(f"  vae step {step:5d}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True)
    log["vae_loss_last50"] = sum(losses[-50:]) / len(losses[-50:])


@torch.no_grad()
def encode(vae, images: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    from demo_model.nets import frame_convs
    with frame_convs():
        return torch.cat([vae.encode((images[i:i + chunk] * 2 - 1).unsqueeze(2))[:, :, 0]
                          for i in range(0, len(images), chunk)])


@torch.no_grad()
def decode(vae, latents: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    from demo_model.nets import frame_convs
    with frame_convs():
        return torch.cat([((vae.decode(latents[i:i + chunk].unsqueeze(2))[:, :, 0] + 1) / 2).clamp(0, 1)
                          for i in range(0, len(latents), chunk)])


@torch.no_grad()
def normalise_latents(vae, images: torch.Tensor, log: dict) -> None:
    """Fold a per-channel affine into conv1 (mu rows) and conv2 so SD3's process_in of a latent is zero-mean,
    unit-variance per channel; decode(encode(x)) is unchanged."""
    mu = encode(vae, images)
    m = mu.mean(dim=(0, 2, 3))
    s = mu.std(dim=(0, 2, 3)).clamp_min(1e-4)
    a = 1.0 / (s * SD3_SCALE)  # mu' = a (mu - m) + SD3_SHIFT
    c1, c2 = vae.conv1, vae.conv2
    c1.weight[:16] *= a.view(-1, 1, 1, 1, 1)
    c1.bias[:16] = a * (c1.bias[:16] - m) + SD3_SHIFT
    w2 = c2.weight[:, :, 0, 0, 0].clone()  # (out, in)
    c2.bias += w2 @ (m - SD3_SHIFT / a)
    c2.weight /= a.view(1, -1, 1, 1, 1)
    log["latent_channel_std_before"] = [round(v, 4) for v in s.tolist()]


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


def train_classifier(clf, images, labels, steps: int, log: dict, batch: int = 64) -> None:
    opt = torch.optim.AdamW(clf.parameters(), lr=2e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        idx = torch.randint(len(images), (batch,), generator=g)
        x = images[idx]
        x = (x + 0.04 * torch.randn(x.shape, generator=g)).clamp(0, 1)  # robust to a little sampling noise
        for grp in opt.param_groups:
            grp["lr"] = cosine_lr(step, steps, 2e-3, warmup=50)
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
    ap.add_argument("--vae-steps", type=int, default=900)
    ap.add_argument("--vae-full-steps", type=int, default=150)
    ap.add_argument("--dit-steps", type=int, default=5000)
    ap.add_argument("--dit-images", type=int, default=20000)
    ap.add_argument("--cls-steps", type=int, default=800)
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
    n_pool = min(6000, args.dit_images)
    images, scenes = shapes.batch(args.dit_images, rng)
    log["seconds"]["render"] = time.perf_counter() - t
    print(f"rendered {len(images)} pictures in {log['seconds']['render']:.1f} s", flush=True)

    t = time.perf_counter()
    vae = nets.build_vae()
    train_vae(vae, images[:n_pool], args.vae_steps, args.vae_full_steps, log)
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
    clf = nets.new_classifier()
    train_classifier(clf, images, labels, args.cls_steps, log)
    clf.eval()
    log["classifier_acc_recon"] = accuracy(clf, recon, scenes[:256])[0]
    log["seconds"]["classifier"] = time.perf_counter() - t

    t = time.perf_counter()
    tests = list(shapes.TEST_SCENES) * 4
    ctx = torch.cat([text.encode(s.caption)[0] for s in tests])
    pool = torch.cat([text.encode(s.caption)[1] for s in tests])
    ema.eval()
    lat = sample(ema, ctx, pool, empty, seed=123)
    pics = decode(vae, lat / SD3_SCALE + SD3_SHIFT)
    acc, preds = accuracy(clf, pics, tests)
    log["sample_acc_test_captions_x4"] = acc
    log["seconds"]["check"] = time.perf_counter() - t
    log["seconds"]["total"] = time.perf_counter() - t_all
    print(f"classifier on VAE reconstructions: {log['classifier_acc_recon']:.3f}; on the model's samples of the "
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
