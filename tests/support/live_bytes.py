"""Counts the bytes of every storage alive inside a block of code (a torch dispatch mode): the peak of live memory
of a computation, on the CPU."""

import torch


class LiveBytes:
    """A dispatch mode that follows every storage allocated inside it (alive while any tensor on it is):
    ``peak`` is the most bytes alive at once."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        owner = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                owner._track(out, args, kwargs)
                return out

        self.mode = Mode()
        self.live, self.now, self.peak = {}, 0, 0

    def _drop(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def _track(self, out, args, kwargs):
        import weakref

        from torch.utils._pytree import tree_flatten

        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.live:
                if key in inputs:
                    continue  # a view of (or written into) a tensor made outside
                self.live[key] = [t.untyped_storage().nbytes(), 0]
                self.now += self.live[key][0]
                self.peak = max(self.peak, self.now)
            self.live[key][1] += 1
            weakref.finalize(t, self._drop, key)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
