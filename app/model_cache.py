"""The loaded models every browser session shares, bounded by bytes and idle time rather than by count.

Streamlit's cache_resource bounds entries by number: 16 models of 500 MB each would hold 8 GB. Here the least
recently used models are let go once the total passes the budget (MIXSCOPE_MODEL_CACHE_MB, default 4,096), and
any model unused for MIXSCOPE_MODEL_IDLE_S seconds (default 1,800) is let go at the next request. A model just
loaded is kept even when it alone passes the budget (a page needs it); one that a running computation still
holds stays in memory until that computation ends, as Python frees it. Before a load, make_room lets go of what the
new model would push past the budget, so that the cache and the load together hold the budget and one model more
(a load briefly holds twice its model) rather than the budget and two.

The cache is the one owner of the models: pages hold app.common.PageModel, which takes its model from here each
time (docs/deployment.md, "Memory").
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from kernels import settings
from models import graphs, packing


def nbytes(loaded) -> int:
    """Bytes of a loaded model's parameters and buffers, and on a GPU the packed copies its CUDA-graph decode
    keeps (models.packing)."""
    model = loaded.model
    own = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    decodes_from_graphs = model.wte.weight.is_cuda and graphs.refusal(model, "static") is None
    return own + (packing.size(model) if decodes_from_graphs else 0)


class ModelCache:
    def __init__(self, budget_bytes: int, idle_s: float, clock=time.monotonic, size=nbytes):
        self.budget, self.idle_s, self.clock, self.size = budget_bytes, idle_s, clock, size
        self._items: OrderedDict[str, list] = OrderedDict()   # key -> [value, bytes, last used]; oldest first
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}          # one load per key at a time

    def get(self, key: str, load):
        with self._lock:
            self._drop_idle()
            hit = self._hit(key)
            if hit is not None:
                return hit
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:  # a second session asking for the same model waits for the first load, then shares it
            with self._lock:
                hit = self._hit(key)
                if hit is not None:
                    return hit
            value = load()  # raises: nothing cached
            with self._lock:
                self._items[key] = [value, self.size(value), self.clock()]
                self._loading.pop(key, None)
                self._drop_over_budget(keep=key)
            return value

    def make_room(self, nbytes: int) -> None:
        """Let the least recently used models go until `nbytes` more would stay within the budget (all of them, if
        nbytes alone passes it): called before a load whose size is known from its config."""
        with self._lock:
            while self._items and self.total() + nbytes > self.budget:
                self._items.popitem(last=False)

    def peek(self, key: str):
        """The value if loaded (marked used), else None; never loads."""
        with self._lock:
            self._drop_idle()
            return self._hit(key)

    def _hit(self, key: str):
        """(Under the lock.) The loaded value, marked just used, or None."""
        item = self._items.get(key)
        if item is None:
            return None
        item[2] = self.clock()
        self._items.move_to_end(key)
        return item[0]

    def _drop_idle(self) -> None:
        now = self.clock()
        for key in [k for k, (_, _, used) in self._items.items() if now - used > self.idle_s]:
            del self._items[key]

    def _drop_over_budget(self, keep: str) -> None:
        while self.total() > self.budget and len(self._items) > 1:
            oldest = next(k for k in self._items if k != keep)
            del self._items[oldest]

    def total(self) -> int:
        return sum(b for _, b, _ in self._items.values())

    def keys(self) -> list[str]:
        return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def from_env() -> ModelCache:
    return ModelCache(int(settings.get("MIXSCOPE_MODEL_CACHE_MB") * 2**20), settings.get("MIXSCOPE_MODEL_IDLE_S"))
