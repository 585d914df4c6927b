"""A worker that speaks the real protocol without torch or torch.distributed.

It starts in a fraction of a second, so node logic and the pool's lifecycle and
fault handling are testable fast. Selected with `WorkerPool(fake="BEHAVIOUR")`:

  serve   answer every job: echo returns its tensors, forward / vae_decode their first one
          (bytes copied, so any dtype round-trips), steps runs `n` timed steps
  die     the fault rank exits mid-job       hang   the fault rank stops answering
  slow    every step takes SLOW_S longer     raise  the fault rank raises

`BEHAVIOUR:K` misbehaves only in the pool's first K jobs (job ids are counted
per pool), so a test can check that the next job succeeds after a fault.
The fault rank is the last rank.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .protocol import connect
from .job_run import Cancelled
from .transport import copy_blob
from .worker_main import ParentWatch, read_authkey, serve

BEHAVIOURS = ("serve", "die", "hang", "slow", "raise")
SLOW_S = 0.2


def parse_behaviour(spec: str) -> tuple:
    name, _, count = spec.partition(":")
    if name not in BEHAVIOURS:
        raise ValueError(f"unknown fake behaviour {name!r}; choose one of {', '.join(BEHAVIOURS)}")
    return name, (int(count) if count else None)


class FakeState:
    def __init__(self, rank: int, world: int, spec: str, prefix: str, max_models: int):
        self.rank, self.world, self.prefix, self.max_models = rank, world, prefix, max(1, max_models)
        self.behaviour, self.limit = parse_behaviour(spec)
        self.models: list = []
        self.loads = 0

    def misbehaves(self, job_id: int) -> str:
        if self.behaviour == "serve" or (self.limit is not None and job_id > self.limit):
            return "serve"
        if self.behaviour == "slow" or self.rank == self.world - 1:
            return self.behaviour
        return "serve"

    def fault(self, mode: str, where: str) -> None:
        if mode == "die":
            os._exit(17)
        if mode == "hang":
            time.sleep(3600)
        if mode == "raise":
            raise RuntimeError(f"fake worker rank {self.rank} raised {where}")

    def execute(self, msg: dict, run) -> dict:
        mode = self.misbehaves(int(msg["job"]))
        kind, values, tensors = msg["kind"], dict(msg.get("values") or {}), dict(msg.get("tensors") or {})
        extra = SLOW_S if mode == "slow" else 0.0
        out_values, out_tensors = {}, {}
        if kind == "steps":
            n = int(values.get("n", 4))
            for step in range(1, n + 1):
                if run.cancel_requested:
                    raise Cancelled(f"job {run.job_id} cancelled")
                if step == 1:
                    self.fault(mode, "at step 1")
                time.sleep(float(values.get("sleep_s", 0.0)) + extra)
                run.progress(step, n)
            out_values = {"steps": n, "value": float(n * self.world * (self.world + 1) // 2)}
        elif kind == "echo":
            self.fault(mode, "in echo")
            if self.rank == 0:
                out_tensors = {k: copy_blob(d, self.prefix) for k, d in tensors.items()}
        elif kind in ("forward", "vae_decode"):
            self.fault(mode, f"in {kind}")
            time.sleep(extra)
            if run.cancel_requested:
                raise Cancelled(f"job {run.job_id} cancelled")
            if tensors and self.rank == 0:
                first = sorted(tensors)[0]
                out_tensors = {"out" if kind == "forward" else "image": copy_blob(tensors[first], self.prefix)}
        elif kind == "load_model":  # the driver's decision (residency.py): touch what is held, else evict and build
            key, action = values["key"], values["decision"]["action"]
            evict = values["decision"].get("evict") or ()
            if action == "touch" and key in self.models:
                self.models.remove(key)
                self.models.append(key)
                out_values = {"loaded": False}
            elif action != "build" or (not tensors and not values.get("path")):
                out_values = {"stale": f"{action} {key}: not what this fake rank holds"}
            else:
                self.fault(mode, "while loading")
                self.models = [k for k in self.models if k not in evict and k != key] + [key]  # as the driver decided
                self.loads += 1
                out_values = {"loaded": True}
            out_values.update(loads=self.loads, resident=list(self.models),
                              residency=[{"slot": k, "key": k, "family": "fake"} for k in self.models])
        elif kind == "release":
            out_values = {"released": len(self.models), "residency": []}
            self.models = []
        elif kind == "health":
            out_values = {"pid": os.getpid(), "device": "fake", "resident": list(self.models),
                          "loads": self.loads, "rss_bytes": None}
        else:
            raise ValueError(f"unknown job kind {kind!r}")
        return {"ok": True, "values": out_values, "tensors": out_tensors}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--driver-pid", type=int, required=True)
    p.add_argument("--behaviour", default="serve")
    args = p.parse_args(argv)
    watch = ParentWatch(args.driver_pid, args.rank)
    channel = connect(args.address, read_authkey())
    channel.send("hello", rank=args.rank, pid=os.getpid())
    init = channel.recv(expect={"init"}, timeout=60.0)
    watch.prefix, watch.tmpdir = init["shm_prefix"], os.path.dirname(args.address)
    state = FakeState(args.rank, args.world_size, args.behaviour, init["shm_prefix"], init.get("max_models", 2))
    channel.send("ready", rank=args.rank, ok=True, device="fake")
    serve(channel, args.rank, state.execute, watch)
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
