"""What every run-eval task gets (`TaskContext`) and gives (`EvalTask`).

A task runs the unquantized model and the quantized cache (`TaskContext.make_cache`, the
real runtime) on the same inputs in one invocation and returns its report section: plain
JSON data, with the parameters it ran under. No fake quantization: the quantized side
always goes through a `QuantizedKVCache` and the model's own forward / generate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvq.eval.result_memo import ResultMemo
from kvq.progress import Progress

DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class EvalParams:
    """The grid and sizes the non-window tasks run over (run-eval's flags)."""

    contexts: tuple[int, ...] = DEFAULT_CONTEXTS  # --contexts: prompt lengths in tokens
    depths: tuple[float, ...] = DEFAULT_DEPTHS  # --depths: where a needle sits, 0 = start
    trials: int = 8  # --trials: retrieval trials per (context, depth) cell
    new_tokens: int = 512  # --new-tokens: generated per prompt (decode, speculative)
    prompts: int = 4  # --prompts: prompts for decode / speculative
    memory_budget: int | None = None  # --memory-budget bytes: max concurrent tokens
    seed: int = 0

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


@dataclass
class TaskContext:
    """Everything a task may use; `loaded` is a `kvq.models.loading.LoadedModel`."""

    loaded: object
    make_cache: Callable[[], object]  # a fresh quantized cache (QuantizedKVCache)
    cache_name: str  # the policy name or the artifact path: how reports name the cache
    text: str  # the dataset's text: haystacks and prompts are cut from it
    params: EvalParams
    progress: Progress = field(default_factory=Progress)
    backend: str | None = None
    memo: ResultMemo = field(default_factory=ResultMemo)  # stored results (--result-cache)
    cache_key: str | None = None  # `result_memo.cache_identity` of make_cache's caches

    def baseline(self, what: str, ids, params: dict, compute):
        """The unquantized side's result for `what` on ids: computed, or read back from
        --result-cache (`kvq.eval.result_memo`)."""
        return self.memo.get(self.loaded, what, ids, params, compute)

    def quantized(self, what: str, ids, params: dict, compute):
        """The quantized cache's result for `what` on ids: computed, or read back when
        the same cache (cache_key) computed it before; never kept without a cache_key."""
        if self.cache_key is None:
            return compute()
        return self.memo.get(self.loaded, what, ids, params, compute, cache=self.cache_key)

    @property
    def model(self):
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer


@dataclass(frozen=True)
class EvalTask:
    """A run-eval task: `run` gives its report section; `summary` the rows the terminal
    shows, (metric, baseline, quantized); `plot` writes PNGs into a folder (or None)."""

    name: str
    run: Callable[[TaskContext], dict]
    summary: Callable[[dict], list[tuple[str, str, str]]]
    plot: Callable[[dict, Path], list[Path]] | None = None
