"""Property test: random cache operations against a full-precision oracle.

A random sequence of appends, crops, beam reorders (repeats and drops included),
repeats, selects, forks, save/load round trips and releases runs on a kvq INT8 cache and,
with the same operations, on transformers' `DynamicCache`. After every append the logits
agree within INT8's error; at the end the kvq cache equals, in ledger and next-step
logits, a fresh kvq cache prefilled with the token rows the operations left (the replay
oracle). Invalid operations raise a clear error and change nothing.

Examples: KVQ_FUZZ_EXAMPLES (default 25), shared with tests/test_fuzz.py; KVQ_FUZZ_RANDOM=1
draws new examples instead of the fixed, derandomised ones.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvq.errors import KvqError
from kvq.models.adapters import get_adapter
from kvq.quant.schemes import CachePolicy, LayerPolicy, named_policy
from kvq.runtime.cache import QuantizedKVCache, build_cache
from tests.conftest import make_tiny_model

EXAMPLES = int(os.environ.get("KVQ_FUZZ_EXAMPLES", "25"))
RUNS = {"sequences": 0}  # counted for the closing note (printed by -s)

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 6)),
        st.tuples(st.just("crop"), st.integers(0, 4)),
        st.tuples(st.just("reorder"), st.lists(st.integers(0, 7), min_size=1, max_size=1)),
        st.tuples(st.just("repeat"), st.integers(1, 2)),
        st.tuples(st.just("select"), st.integers(0, 255)),
        st.tuples(st.just("fork"), st.just(0)),
        st.tuples(st.just("save"), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 255)),
        st.tuples(st.just("invalid"), st.integers(0, 1)),
    ),
    min_size=3,
    max_size=10,
)


def _cache(model, sink: int) -> QuantizedKVCache:
    ad = get_adapter(model)
    policy = named_policy("int8", ad.info.num_layers, ad.info.head_dim)
    lp = LayerPolicy(**{**policy.layers[0].__dict__, "sink_tokens": sink})
    return build_cache(model, CachePolicy("int8-sink", (lp,) * ad.info.num_layers), {}, ad)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return make_tiny_model(request.param)


class Driver:
    """Applies one operation to the kvq cache, the oracle and the token rows alike."""

    def __init__(self, model, tmp):
        self.model, self.tmp = model, tmp
        self.kvq = _cache(model, sink=2)
        self.oracle = DynamicCache(config=model.config)
        self.kvq.activate_past_recording()  # crops must be able to go back past the window
        self.oracle.activate_past_recording()
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(3, 300, (2, 5), generator=g)  # the tokens each row holds
        self.gen = g
        self._forward(self.rows)

    @torch.no_grad()
    def _forward(self, ids):
        got = self.model(ids, cache=self.kvq).logits
        want = self.model(ids, cache=self.oracle).logits
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)

    def _select(self, index):
        self.kvq.reorder_cache(index)
        self.oracle.reorder_cache(index)
        self.rows = self.rows[index]

    def apply(self, op, arg):
        b, n = self.rows.shape
        if op == "append":
            ids = torch.randint(3, 300, (b, arg), generator=self.gen)
            self._forward(ids)
            self.rows = torch.cat([self.rows, ids], dim=1)
        elif op == "crop" and arg < n:  # keep at least one token
            self.kvq.crop(-arg)
            self.oracle.crop(-arg)
            self.rows = self.rows[:, : n - arg]
        elif op == "reorder":
            self._select(torch.tensor([i % b for i in range(b)][::-1]) if arg[0] % 2 else
                         torch.tensor([arg[0] % b] * b))  # fmt: skip
        elif op == "repeat" and b * (arg + 1) <= 8:
            self.kvq.batch_repeat_interleave(arg + 1)
            self.oracle.batch_repeat_interleave(arg + 1)
            self.rows = self.rows.repeat_interleave(arg + 1, dim=0)
        elif op == "select":
            keep = torch.tensor([i for i in range(b) if (arg >> i) & 1] or [0])
            self.kvq.batch_select_indices(keep)
            self.oracle.batch_select_indices(keep)
            self.rows = self.rows[keep]
        elif op == "fork":
            twin = self.kvq.fork()
            scratch = torch.randint(3, 300, (b, 2), generator=self.gen)
            with torch.no_grad():
                self.model(scratch, cache=twin)  # the twin moves on; the original must not
        elif op == "save":
            path = self.tmp / "state.safetensors"
            self.kvq.save(path)
            restored = copy.copy(self.kvq)
            restored.layers = [copy.copy(layer) for layer in self.kvq.layers]
            from kvq.runtime.saved import restore_cache

            self.kvq = restore_cache(restored, path)
        elif op == "release" and b > 1:
            done = torch.tensor([bool((arg >> i) & 1) for i in range(b)])
            if not done.all():
                keep = self.kvq.release(done)
                self.oracle.batch_select_indices(keep)
                self.rows = self.rows[keep]
        elif op == "invalid":
            seen = self.kvq.get_seq_length()
            if arg:
                with pytest.raises(ValueError, match="negative"):
                    self.kvq.crop(3)
            else:
                with pytest.raises(KvqError, match="bool"):
                    self.kvq.release(torch.zeros(b + 1, dtype=torch.bool))
            assert self.kvq.get_seq_length() == seen

    @torch.no_grad()
    def check_against_replay(self):
        fresh = _cache(self.model, sink=2)
        fresh.activate_past_recording()
        self.model(self.rows, cache=fresh)
        if not any(layer.is_sliding for layer in fresh.layers):  # eviction timing differs
            assert self.kvq.nbytes() == fresh.nbytes()
        step = torch.randint(3, 300, (self.rows.shape[0], 1), generator=self.gen)
        got = self.model(step, cache=self.kvq).logits
        torch.testing.assert_close(got, self.model(step, cache=fresh).logits, atol=1e-4, rtol=0)
        assert self.kvq.get_seq_length() == self.rows.shape[1] + 1


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("KVQ_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_random_operations_match_the_oracle(model, tmp_path, ops):
    driver = Driver(model, tmp_path)
    for op, arg in ops:
        driver.apply(op, arg)
    driver.check_against_replay()
    RUNS["sequences"] += 1
