"""LayerView: what a kvq cache's `update` hands to the attention function.

It lives apart from the cache so that the attention function (`kvq.runtime.attention`),
which the cache installs, can recognise a view without importing the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from kvq.errors import KvqError

if TYPE_CHECKING:  # annotations only: the cache imports this module
    from kvq.runtime.cache import QuantizedKVCache
    from kvq.runtime.layers import KvqLayer, LayerState


@dataclass(frozen=True)
class LayerView:
    """What `update` hands to the attention function instead of K/V tensors.

    The attention function calls `prepare(mask)`: the layer's new rows become its
    transaction-private successor state, which it then reads chunk by chunk.
    """

    cache: QuantizedKVCache
    layer: KvqLayer

    @property
    def columns(self) -> int:
        """Mask columns once this forward's rows are appended."""
        return self.layer.state.visible + self.cache._txn.query_len

    def prepare(self, mask: Tensor | None) -> LayerState:
        return self.cache._prepare(self.layer.layer_idx, mask)

    @property
    def query_positions(self) -> Tensor:
        """[B, Q] RoPE positions of this forward's queries (= its new rows)."""
        return self.cache._txn.positions

    @property
    def shape(self) -> tuple[int, ...]:  # informative only; never a real tensor
        return (-1, -1, self.columns, -1)

    # A model whose attention is not kvq's treats the view as K/V tensors: say why it fails.
    def _not_kvq_attention(self, *_args, **_kwargs):
        self.cache.abort()
        raise KvqError(
            "this kvq cache reached a model whose attention is not kvq's; build a cache for "
            "that model with kvq.make_cache (a cache serves the model it was made for)"
        )

    __getitem__ = __iter__ = __len__ = __array__ = _not_kvq_attention

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probe dunders: stay quiet
            raise AttributeError(name)
        self._not_kvq_attention()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        view = next((a for a in args if isinstance(a, LayerView)), None)
        if view is None:
            raise KvqError("a kvq cache's layer view reached a torch function")
        view._not_kvq_attention()
