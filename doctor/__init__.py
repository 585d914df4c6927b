"""Self-check: does this machine run the pack correctly, and how fast - the first command on a new box.

    python -m comfyui_hybrid_parallel.doctor [--devices auto|cpu|cuda] [--quick] [--json PATH]

Why a separate command: a wrong NCCL set-up, an attention kernel whose log-sum-exp is missing or a
GPU path nobody ran fails in the middle of a user's first prompt, far from its cause. The doctor
runs the pack's real path on a tiny random model (the embedded default model, ComfyUI's own
MMDiT class) before that:

1. the machine: devices, backends (NCCL/gloo), peer access between GPUs, shared memory (Docker's
   64 MB default breaks the weight transport), ComfyUI found;
2. every attention kernel with LSE that ring attention may pick here, against a float64 reference,
   plus a three-block ring merge of its partial results; one timing each;
3. every parallel method and degree that fits the devices, through the persistent worker pool
   (the processes, transport and ComfyUI-native build the nodes use), against ComfyUI's own
   forward in this process on the same device: degree 1 bitwise, exact methods <= 1e-5 relative
   where ComfyUI computes in fp32 (a measured 2e-2 bound where it computes in bf16/fp16 itself),
   latents that split evenly and unevenly; one step timed per method next to the serial step.

Meshes wider than the GPUs run on CPU workers (gloo), labelled so. It prints tables, writes JSON
and exits 1 on any mismatch (2 when it cannot run at all), so CI and users can rely on the code.
"""
from .cli import main

__all__ = ["main"]
