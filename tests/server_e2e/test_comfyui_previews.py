"""Latent previews and progress reach a websocket client for Hybrid Sampler as they do for KSampler.

Step mode runs ComfyUI's own sampler, so its preview callback fires on every step with the pool's
denoised latent; in loop mode rank 0 attaches each step's denoised latent to its progress event and the
driver feeds ComfyUI's callback with it. The session's server runs --preview-method latent2rgb.
"""
import asyncio
import json
import uuid

import pytest

from comfy_server import workflow

pytestmark = pytest.mark.comfy

PREVIEW_EVENTS = {1, 4}  # ComfyUI's BinaryEventTypes PREVIEW_IMAGE, PREVIEW_IMAGE_WITH_METADATA


async def _watch(server, graph, timeout_s=300.0):
    """Queue `graph` for a fresh client id and count what that client receives until the prompt ends."""
    import aiohttp
    cid = str(uuid.uuid4())
    previews, progress, status = 0, [], None
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(f"{server.url}/ws?clientId={cid}") as ws:
            async with s.post(f"{server.url}/prompt", json={"prompt": graph, "client_id": cid}) as r:
                pid = (await r.json())["prompt_id"]
            while status is None:
                msg = await ws.receive(timeout=timeout_s)
                if msg.type == aiohttp.WSMsgType.BINARY:
                    previews += int.from_bytes(msg.data[:4], "big") in PREVIEW_EVENTS
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    m = json.loads(msg.data)
                    data = m.get("data") or {}
                    if data.get("prompt_id") not in (None, pid):
                        continue
                    if m["type"] == "progress":
                        progress.append((data.get("node"), data["value"], data["max"]))
                    elif m["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                        status = m["type"]
                else:
                    raise AssertionError(f"websocket closed: {msg}")
    return previews, progress, status


@pytest.mark.parametrize("degrees", [
    {"ulysses_degree": 2},
    {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 1},
    {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 1, "sampling_mode": "loop"},
], ids=["ulysses2", "distrifusion", "distrifusion-loop"])
def test_previews_and_progress_like_ksampler(server, degrees):
    steps = 4
    ref, hp = workflow(None, "pv_ref", 104, 72, steps=steps), workflow(degrees, "pv_hp", 104, 72, steps=steps)
    for g in (ref, hp):  # a seed no other test uses: a KSampler ComfyUI cached from the previous prompt sends nothing
        g["5"]["inputs"]["seed"] = 9173
    ref = asyncio.run(_watch(server, ref))
    got = asyncio.run(_watch(server, hp))
    assert ref[2] == got[2] == "execution_success", (ref, got)
    assert ref[0] == steps and got[0] == ref[0], f"previews: KSampler {ref[0]}, Hybrid Sampler {got[0]}"
    assert [p[1:] for p in got[1] if p[0] == "5"] == [(i, steps) for i in range(1, steps + 1)], got[1]
