"""The path of one prompt through the pack's product files, recorded in every process it crosses (ComfyUI's, the
fork server's, each rank's) - tests/server_e2e/test_one_prompt.py puts this folder on PYTHONPATH of its own server.

Per process, each entry once, appended to HP_TRACE_DIR/<pid>.txt as it is first seen:
- "ran <file>": a product file a function of which was called (its import alone is not counted);
- "stack <target> <- <file>:<function> <- ...": each distinct stack of product frames when the prompt's work leaves
  the process or the rank - a message sent on the control channel (workers/protocol.py Channel.send_encoded) or a
  torch.distributed collective. Its files are the ones a reader follows from the node to the send and from the
  rank's job to the collective; the other "ran" files are called and return on the way (checks, codecs, tables).
The sets start again when HP_TRACE_DIR/epoch changes (the test bumps it just before its prompt), and in a forked
child; the frames live at that moment (a rank's job loop, ComfyUI's queue - entered before the prompt began) are not
on its path. Inert without HP_TRACE_DIR. Never imported by the pack.
"""
import os
import sys
import threading
import time

_DIR = os.environ.get("HP_TRACE_DIR")
_PRODUCT = ("__init__.py", "nodes/", "parallel/", "workers/")
_COLLECTIVES = {"all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
                "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "gather",
                "scatter", "reduce"}


def _chain(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _install(out: str, root: str) -> None:
    root = os.path.realpath(root) + os.sep
    names: dict = {}
    state = {"pid": None, "fd": None, "epoch": None, "checked": 0.0, "ran": set(), "path": set(), "before": {}}
    epoch_file = os.path.join(out, "epoch")

    def product(filename):
        rel = names.get(filename, 0)
        if rel == 0:
            real = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
            rel = real[len(root):] if real.startswith(root) else None
            if rel is not None and not rel.startswith(_PRODUCT):
                rel = None
            names[filename] = rel
        return rel

    def write(line: str) -> None:
        if state["pid"] != os.getpid():  # a forked child: its own file and sets
            state.update(pid=os.getpid(), ran=set(), path=set(), epoch=None,
                         fd=os.open(os.path.join(out, f"{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND))
            os.write(state["fd"], f"argv {' '.join(sys.argv)[:200]}\n".encode())
        os.write(state["fd"], (line + "\n").encode())

    def epoch() -> None:
        try:
            now = os.stat(epoch_file).st_mtime_ns
        except OSError:
            now = None
        if now != state["epoch"] or state["pid"] != os.getpid():
            write(f"epoch {now}")
            # the frames live now were entered before this prompt (a rank's job loop, ComfyUI's queue): not its path
            live = {id(f): f for top in sys._current_frames().values() for f in _chain(top)}
            state.update(epoch=now, ran=set(), path=set(), before=live)

    def profile(frame, event, arg):
        if event != "call":
            return
        if state["pid"] != os.getpid() or time.monotonic() - state["checked"] > 0.2:
            state["checked"] = time.monotonic()
            epoch()
        code = frame.f_code
        rel = product(code.co_filename)
        if rel is not None:
            if rel not in state["ran"] and code.co_flags & 0x2:  # a function called (CO_NEWLOCALS), not an import
                state["ran"].add(rel)
                write(f"ran {rel}")
            if not (rel == "workers/protocol.py" and code.co_name == "send_encoded"):
                return
        elif code.co_name not in _COLLECTIVES or \
                not code.co_filename.endswith(os.path.join("torch", "distributed", "distributed_c10d.py")):
            return
        stack = []
        for f in _chain(frame):
            if state["before"].get(id(f)) is f:
                break  # entered before the prompt began: the process's own loop, not the prompt's path
            r = product(f.f_code.co_filename)
            if r is not None:
                stack.append(f"{r}:{f.f_code.co_name}")
        line = " <- ".join(stack)
        if stack and line not in state["path"]:
            state["path"].add(line)
            write(f"stack {code.co_name} <- {line}")

    sys.setprofile(profile)
    threading.setprofile(profile)


if _DIR:
    _install(_DIR, os.environ["HP_TRACE_ROOT"])
