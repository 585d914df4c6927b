"""LiveBytes: the peak bytes of tensor storages allocated inside it and still alive - what a decode or a forward holds
at once, the weights and inputs (made before) not counted. On CUDA torch.cuda.max_memory_allocated would be used
instead; this counts the same on the CPU. Used by bench_memory.py and bench_vae_native.py."""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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
