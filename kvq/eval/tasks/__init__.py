"""`kvq run-eval --tasks ...`: one module per task, found through `REGISTRY`.

The window tasks (ppl, kld, bytes) score fixed windows of the dataset (`kvq.eval.quality`);
every other task is an `EvalTask` in a module of its own here, run against the unquantized
model and the quantized cache in the same invocation. A new task is one new file with a
`TASK` and one line in `REGISTRY`.
"""

from __future__ import annotations

import importlib

from kvq.errors import KvqError
from kvq.eval.tasks.base import EvalTask

WINDOW_TASKS = ("ppl", "kld", "bytes")
# task name -> module holding its TASK (imported only when the task runs)
REGISTRY = {
    "passkey": "kvq.eval.tasks.passkey",
    "needle": "kvq.eval.tasks.needle",
    "decode": "kvq.eval.tasks.decode",
    "speculative": "kvq.eval.tasks.speculative",
    "attention": "kvq.eval.tasks.attention",
    "latency": "kvq.eval.tasks.latency",
    "memory": "kvq.eval.tasks.memory",
}
ALL_TASKS = (*WINDOW_TASKS, *REGISTRY)


def get_task(name: str) -> EvalTask:
    if name not in REGISTRY:
        raise KvqError(f"unknown task {name!r}; choose from {', '.join(ALL_TASKS)}")
    task = importlib.import_module(REGISTRY[name]).TASK
    assert task.name == name, (task.name, name)
    return task
