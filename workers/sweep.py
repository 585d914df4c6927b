"""What dead pools left behind, swept when a pool starts: their shared-memory files and their folders. Its own file
because it is housekeeping over every pool's files, not the transport of one pool's tensors (transport.py)."""
from __future__ import annotations

import os
import re
import shutil
import tempfile

from .transport import file_dirs


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_stale(tmp_root: str | None = None) -> int:
    """Remove what dead pools left behind: shared-memory files `chp-<pid>-...`, pool folders `chp-pool-<pid>-...`
    and the fork servers' working folders `chp-forks-<pid>-...` (workers/driver/runtime.py; `chp-spares-` of older versions) whose creating process
    is gone, owned by this user (a ComfyUI killed together with its rank 0 cannot clean up after itself). Live
    pools and other users' files are never touched; returns how many entries were removed."""
    uid, n = os.getuid() if hasattr(os, "getuid") else None, 0
    files = r"chp-(\d+)-[0-9a-f]{8}-"
    folders = r"chp-(?:pool|forks|spares)-(\d+)-"
    for root, pattern in [*((d, files) for d in file_dirs()), (tmp_root or tempfile.gettempdir(), folders)]:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            m = re.match(pattern, name)
            if not m or _pid_alive(int(m.group(1))):
                continue
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
                if uid is not None and st.st_uid != uid:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
                n += 1
            except OSError:
                pass
    return n
