"""Tensors between processes through shared-memory files, described in messages by (name, dtype, shape).

Why files under /dev/shm rather than pickling through the socket: the bytes are
written once by the creator and read (or, for weights, mapped) by every reader,
with no pickling and no socket traffic beyond a small JSON descriptor.
Why not `multiprocessing.shared_memory`: before Python 3.13 every
process that attaches registers the segment with its resource tracker, which
unlinks (or warns about) it when that process exits - wrong for a segment the
driver owns. Plain files give us full control of the lifetime:

* every file name starts with the pool's private prefix, so `cleanup_prefix`
  removes whatever a crashed process left behind;
* the creator unlinks its files when the job is done; the driver reads a
  result and unlinks it at once, so nothing is left in /dev/shm.

Per-step tensors (latents, conditioning, results) go through an `Arena`
instead: one file per writer (the driver for inputs, rank 0 for results),
mapped once and reused by every job, each tensor at an offset. A new file per
tensor cost about 1.2 ms per MiB (create, fault in fresh tmpfs pages, unlink);
a copy into already-mapped pages costs about 0.04 ms. Jobs are sequential and
a writer only reuses its arena after every reader has answered, so the bytes
are never overwritten while read. Weights, and tensors over ARENA_MAX_BYTES
(a whole decoded video), still get a file of their own, so the arena never
pins a huge buffer in /dev/shm.

Never a signal on a full /dev/shm (Docker's default is 64 MiB): a file written through a mapping is
reserved first (posix_fallocate), so a full tmpfs answers ENOSPC instead of SIGBUS at the first write;
then the file goes to a disk-backed fallback directory (HP_SHM_FALLBACK_DIR, default the temp dir)
with a warning naming the fix, and if that is full too the error says so. Readers look in both.
HP_SHM_DIR replaces /dev/shm.

Torch is imported lazily: the fake worker moves raw bytes without it.
"""
from __future__ import annotations

import errno
import glob
import logging
import mmap
import os
import shutil
import tempfile
import uuid

# float8_e8m0fnu: the per-block scales of ComfyUI's mxfp8 quantized weights (a power of two per byte)
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1}
TRAVEL_DTYPES = tuple(_ITEMSIZE)


class SharedMemoryFull(OSError):
    """Neither the shared-memory directory nor its fallback has room for a tensor."""


def shm_dir() -> str:
    override = os.environ.get("HP_SHM_DIR")
    if override:
        return override
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def fallback_dir() -> str:
    return os.environ.get("HP_SHM_FALLBACK_DIR") or tempfile.gettempdir()


def file_dirs() -> list:
    first, second = shm_dir(), fallback_dir()
    return [first] if os.path.realpath(first) == os.path.realpath(second) else [first, second]


def _free_mib(d: str) -> float:
    try:
        st = os.statvfs(d)
        return st.f_bavail * st.f_frsize / 2 ** 20
    except OSError:
        return float("nan")


_warned: set = set()


def _full(d: str, nbytes: int, last: bool) -> None:
    """Say what is full, and the fix; raise when nothing is left to try."""
    msg = (f"{d} has {_free_mib(d):.0f} MiB free, a tensor of {nbytes / 2 ** 20:.1f} MiB does not fit")
    hint = ("give the container more shared memory (docker run --shm-size=16g, or --ipc=host), or point "
            "HP_SHM_DIR / HP_SHM_FALLBACK_DIR at a directory with room")
    if last:
        raise SharedMemoryFull(errno.ENOSPC, f"hybrid parallel: {msg}, and no fallback has room either; {hint}")
    if d not in _warned:
        _warned.add(d)
        logging.getLogger(__name__).warning("hybrid parallel: %s; using %s (disk-backed, slower) instead; %s",
                                            msg, fallback_dir(), hint)


def new_prefix() -> str:
    """A per-pool prefix; only files carrying it are ever opened or cleaned up by the pool."""
    return f"chp-{os.getpid()}-{uuid.uuid4().hex[:8]}-"


def _path(name: str, prefix: str) -> str:
    """Where the pool's file `name` is: the shared-memory directory, else the fallback (see the module doc)."""
    if not name.startswith(prefix) or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"shared-memory name {name!r} does not belong to this pool (prefix {prefix!r})")
    dirs = file_dirs()
    primary = os.path.join(dirs[0], name)
    if len(dirs) > 1 and not os.path.exists(primary):
        fallback = os.path.join(dirs[1], name)
        if os.path.exists(fallback):
            return fallback
    return primary


def tensor_dtype(name: str):
    import torch
    if name not in TRAVEL_DTYPES:
        raise ValueError(f"dtype {name!r} cannot travel through the pool; supported: {', '.join(TRAVEL_DTYPES)}")
    return getattr(torch, name)


def new_name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _create(prefix: str, nbytes: int, reserve: bool = False, start: int = 0, name: str | None = None) -> tuple:
    """A new private file of `nbytes`: (name, fd). `reserve`: allocate the pages now (a file that is written
    through a mapping must be, or a full tmpfs kills the writer with SIGBUS). `start`: the first directory to try.
    `name`: chosen by the caller (new_name), e.g. to protect it from a concurrent cleanup before it exists."""
    name = name or new_name(prefix)
    dirs = file_dirs()
    for i in range(start, len(dirs)):
        path = os.path.join(dirs[i], name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if reserve and nbytes and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                        raise  # (EOPNOTSUPP etc. would be raised here too: only tmpfs matters, and it supports it)
                    os.close(fd)
                    os.unlink(path)
                    _full(dirs[i], nbytes, last=i == len(dirs) - 1)
                    continue
            return name, fd
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    raise SharedMemoryFull(errno.ENOSPC, "no directory to write to")  # not reached: _full raised


def _bytes_view(t):
    """A writable byte view of a contiguous CPU tensor (numpy has no bfloat16, so go through uint8)."""
    return memoryview(_tensor_bytes(t)).cast("B")


def nbytes(tensors: dict) -> int:
    """The bytes of a dict's tensors (what a job moves through shared memory)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def lead_of(t) -> int:
    """Where `t`'s bytes start within a 64-byte line (0 where that is no whole number of its elements, or off the
    host): the bytes of padding its file starts with, so that a mapping of it starts where `t` does.

    Why: a CPU matmul's rounding depends on where its operands start - MKL / oneDNN peel the elements before the
    first aligned vector. ComfyUI's loader computes with tensors mapped from the checkpoint at the file's offsets
    (an fp32 bias behind fp8 bytes starts 4 or 48 bytes into a line), so a page-aligned copy of them computed
    KSampler's latent 2.8e-7 apart at cfg 1 on the tiny scaled-fp8 SD3 (int8 tensorwise 8.4e-4: a flipped int8
    step). Mapped at the same offset within the line, the workers (and the driver's copy it adopts) compute
    ComfyUI's bits."""
    if t.device.type != "cpu" or t.numel() == 0:
        return 0
    lead = t.data_ptr() % ARENA_ALIGN
    return lead if lead % t.element_size() == 0 else 0


def write_tensor(t, prefix: str, name: str | None = None, lead: int = 0) -> dict:
    """Copy `t` into a new shared-memory file; returns its descriptor (the caller owns the file). `lead`: bytes of
    padding before the tensor's (`lead_of`), named in the descriptor where not 0.

    os.write rather than writing through a mapping: the kernel copies straight
    into the file's pages, without one page fault per 4 KiB in this process
    (measured 8x faster for 1 MiB in a sandboxed VM, see bench_transport.py).
    """
    dtype = str(t.dtype).removeprefix("torch.")
    tensor_dtype(dtype)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    desc = {"name": None, "dtype": dtype, "shape": list(t.shape)}
    if t.numel() == 0:
        return desc
    nbytes = t.numel() * t.element_size()
    view = _bytes_view(t.contiguous())
    if lead:
        desc["lead"] = lead
    for start in range(len(file_dirs())):
        name, fd = _create(prefix, lead + nbytes, start=start, name=name)
        try:
            os.lseek(fd, lead, os.SEEK_SET)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        except OSError as e:  # os.write reports a full directory as ENOSPC (never a signal): try the next one
            os.close(fd)
            os.unlink(_path(name, prefix))
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise
            _full(file_dirs()[start], nbytes, last=start == len(file_dirs()) - 1)
            continue
        os.close(fd)
        desc["name"] = name
        return desc
    raise SharedMemoryFull(errno.ENOSPC, "no directory to write to")


WEIGHT_PREFIX = "sd."  # tensors named so are model weights: a file each, mapped copy-on-write by every rank
ARENA_ALIGN = 64
ARENA_MAX_BYTES = 64 << 20


class Arena:
    """One growing shared-memory file that this process writes job tensors into, reused across jobs."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.name, self.capacity, self._buf = None, 0, None

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity, 1 << 20)
        try:
            name, fd = _create(self.prefix, cap, reserve=True)
        except SharedMemoryFull:
            if cap == need:
                raise
            cap = need  # no room to double: exactly what this job needs
            name, fd = _create(self.prefix, cap, reserve=True)
        try:
            mm = mmap.mmap(fd, cap)
        finally:
            os.close(fd)
        self.close()  # readers that mapped the old file keep their mapping; the name is gone
        self.name, self.capacity, self._buf = name, cap, mm

    def write(self, tensors: dict) -> dict:
        """Descriptors for `tensors`, written at aligned offsets (tensors too big for it get their own file)."""
        small, descs, total = {}, {}, 0
        for k, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if nbytes == 0 or nbytes > ARENA_MAX_BYTES:
                descs[k] = write_tensor(t, self.prefix)
                continue
            small[k] = (total, nbytes)
            total += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
        if not small:
            return descs
        if total > self.capacity:
            self._grow(total)
        for k, (off, nbytes) in small.items():
            t = tensors[k].detach()
            dtype = str(t.dtype).removeprefix("torch.")
            tensor_dtype(dtype)
            _copy_bytes(_np_bytes(self._buf, off, nbytes), _tensor_bytes(t.contiguous()))
            descs[k] = {"name": self.name, "offset": off, "dtype": dtype, "shape": list(t.shape)}
        return descs

    def close(self) -> None:
        if self.name is not None:
            try:
                os.unlink(_path(self.name, self.prefix))
            except FileNotFoundError:
                pass
        self.name, self.capacity, self._buf = None, 0, None


def _np_bytes(mm, off: int, nbytes: int):
    import numpy as np
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=off)


def _tensor_bytes(t):
    """A contiguous CPU tensor's bytes as a numpy uint8 array (any dtype, bfloat16 included; no copy)."""
    import torch
    return t.reshape(-1).view(torch.uint8).numpy()


def _copy_bytes(dst, src) -> None:
    """One single-threaded memcpy. Not torch's copy_: for a MiB it wakes the intra-op thread pool, whose
    sleeping threads took 4-8 ms to wake per job on this VM (measured: 8 ms vs 1 ms per 1 MiB round trip)."""
    import numpy as np
    np.copyto(dst, src, casting="no")


def _arena_bytes(desc: dict, prefix: str, maps):
    """The arena named by `desc` as an mmap; mapped once per name when `maps` (a dict) is given."""
    name = desc["name"]
    buf = maps.get(name) if maps is not None else None
    if buf is None:
        with open(_path(name, prefix), "r+b") as f:
            buf = mmap.mmap(f.fileno(), 0)
        if maps is not None:
            while len(maps) >= 4:  # an arena that grew was replaced: forget the oldest mapping
                maps.pop(next(iter(maps)))
            maps[name] = buf
    return buf


def read_tensor(desc: dict, prefix: str, mapped: bool = False, unlink: bool = False, maps: dict | None = None,
                view: bool = False, shared: bool = False):
    """The described tensor: a private copy (default), or a copy-on-write mapping (`mapped=True`).

    Copying suits per-step tensors (fast, and the file can go at once); mapping
    suits model weights: ranks share the pages until someone writes, so N ranks
    do not hold N copies. `unlink=True` removes the file after reading (a mapping
    stays valid after unlink); `shared=True` maps it shared instead (MAP_SHARED: what its writer later writes into
    those pages in place is what this mapping reads - weights another rank rewrites, never written through here). An
    arena descriptor (with "offset") is copied out
    and never unlinked; `maps` caches the arena mappings between calls. `view=True` returns an arena
    tensor in place instead, no copy: valid only until the writer reuses its arena (its next job), so only for
    what a job does not keep (a step's latent); it shares the writer's pages - and, on CPU ranks, the other
    ranks' - so nothing may write to it (the model's first op on a latent makes a new tensor).
    """
    import torch
    dtype = tensor_dtype(desc["dtype"])
    shape = [int(s) for s in desc["shape"]]
    numel = 1
    for s in shape:
        numel *= s
    if desc.get("name") is None:
        if numel != 0:
            raise ValueError(f"descriptor without a name for a non-empty tensor of shape {shape}")
        return torch.empty(shape, dtype=dtype)
    if "offset" in desc:
        off, nbytes = int(desc["offset"]), numel * dtype.itemsize
        buf = _arena_bytes(desc, prefix, maps)
        if off < 0 or off + nbytes > len(buf):
            raise ValueError(f"arena {desc['name']} holds {len(buf)} bytes, not [{off}, {off + nbytes})")
        if view and nbytes:
            return torch.frombuffer(buf, dtype=dtype, count=numel, offset=off).view(shape)
        out = torch.empty(shape, dtype=dtype)
        _copy_bytes(_tensor_bytes(out), _np_bytes(buf, off, nbytes))
        return out
    path = _path(desc["name"], prefix)
    lead = int(desc.get("lead", 0))
    if mapped and lead:  # the file's first `lead` bytes are padding (write_tensor): the tensor starts as its source did
        nbytes = numel * dtype.itemsize
        t = torch.from_file(path, shared=shared, size=lead + nbytes, dtype=torch.uint8)[lead:].view(dtype).view(shape)
    elif mapped:
        t = torch.from_file(path, shared=shared, size=numel, dtype=dtype).view(shape)
    else:
        t = torch.empty(shape, dtype=dtype)
        view, done = _bytes_view(t), 0
        with open(path, "rb", buffering=0) as f:
            f.seek(lead)
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"shared-memory file {desc['name']} is shorter than its {dtype} {shape}")
                done += got
    if unlink:
        os.unlink(path)
    return t


def unlink(desc: dict, prefix: str) -> None:
    if desc.get("name") and "offset" not in desc:  # arenas live as long as their writer
        try:
            os.unlink(_path(desc["name"], prefix))
        except FileNotFoundError:
            pass



def new_mapped(prefix: str, name: str, shape, dtype) -> tuple:
    """(descriptor, tensor): a new file `name` of that shape and dtype, its pages allocated (posix_fallocate: a full
    tmpfs is an error here, never a SIGBUS later), mapped shared and writable - a tensor computed in place where the
    other ranks will map it, instead of computed elsewhere, then copied by os.write and freed."""
    import torch
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    _, fd = _create(prefix, nbytes, reserve=True, name=name)
    os.close(fd)
    t = torch.from_file(_path(name, prefix), shared=True, size=numel, dtype=dtype).view([int(s) for s in shape])
    return {"name": name, "dtype": str(dtype).removeprefix("torch."), "shape": [int(s) for s in shape]}, t

def write_weights(sd: dict, prefix: str, written: set, adopt=None) -> dict:
    """{WEIGHT_PREFIX + name: descriptor} of `sd` written into shared-memory files, `sd` emptied as they are.

    A few threads: os.write releases the GIL, so a large model's copy spreads over the cores. Each file's name joins
    `written` before the file exists (the caller's record of files not yet handed to a job). `adopt(name, mapped)`
    gets each tensor mapped back from its file as soon as it is written, the written tensor already let go, so the
    caller's copy becomes those pages tensor by tensor (never a second full copy); `adopt.done()`, if any, runs
    once all are written. A failure (shared memory full) removes what was written and raises the first error."""
    from concurrent.futures import ThreadPoolExecutor, wait

    def write(k, box):
        name = new_name(prefix)
        written.add(name)
        t = box.pop()
        desc = write_tensor(t, prefix, name=name, lead=lead_of(t))  # where ComfyUI's tensor starts in its line
        del t  # the only reference, gone once written
        if adopt is not None and desc.get("name"):
            adopt(k, read_tensor(desc, prefix, mapped=True))
        return desc
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as ex:
        futures = {f"{WEIGHT_PREFIX}{k}": ex.submit(write, k, [sd.pop(k)]) for k in list(sd)}
        wait(list(futures.values()))
    if adopt is not None and getattr(adopt, "done", None) is not None:
        adopt.done()
    failed = next((f.exception() for f in futures.values() if f.exception() is not None), None)
    if failed is not None:
        for f in futures.values():
            if f.exception() is None:
                unlink(f.result(), prefix)
                written.discard(f.result()["name"])
        raise failed
    return {name: f.result() for name, f in futures.items()}

def copy_blob(desc: dict, prefix: str) -> dict:
    """A new file with the same bytes (the fake worker's echo; no torch needed)."""
    if desc.get("name") is None:
        return dict(desc)
    src = _path(desc["name"], prefix)
    if "offset" in desc:  # a slice of an arena: dtype sizes without torch
        n = 1
        for s in desc["shape"]:
            n *= int(s)
        n *= _ITEMSIZE[desc["dtype"]]
        with open(src, "rb") as fi:
            fi.seek(int(desc["offset"]))
            data = fi.read(n)
        name, fd = _create(prefix, n, reserve=True)
        with open(fd, "r+b") as fo:
            fo.write(data)
        return {k: v for k, v in desc.items() if k != "offset"} | {"name": name}
    name, fd = _create(prefix, os.path.getsize(src), reserve=True)
    with open(src, "rb") as fi, open(fd, "r+b") as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)
    return {**desc, "name": name}


def list_prefix(prefix: str) -> list:
    if not prefix or "/" in prefix:
        raise ValueError(f"bad prefix {prefix!r}")
    return sorted(p for d in file_dirs() for p in glob.glob(os.path.join(glob.escape(d), glob.escape(prefix) + "*")))


def cleanup_prefix(prefix: str, keep=()) -> int:
    """Remove every file this pool (or one of its dead workers) left behind, but the names in `keep` (files written
    for a job that has not run yet); returns how many.

    `keep` may be a function returning those names: it is asked *after* the directory was listed. A writer names a
    file (records it to keep) before it creates it, so every file the listing found whose writer wants it kept is
    then among the names; a set taken before the listing missed the files named and created in between - weights
    that ensure_model was writing while another thread restarted the world (Parallel Config's prestart), which the
    next load_model then could not open."""
    found = list_prefix(prefix)
    if callable(keep):
        keep = set(keep())
    n = 0
    for p in found:
        if os.path.basename(p) in keep:
            continue
        try:
            os.unlink(p)
            n += 1
        except FileNotFoundError:
            pass
    return n
