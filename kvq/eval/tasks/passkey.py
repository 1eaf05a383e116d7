"""`passkey`: repeat a random 5-digit pass key hidden in a haystack of the dataset's text.

The classic long-context retrieval probe (Mohtashami & Jaggi, 2023): the key is stated
twice in one inserted passage, and the prompt ends mid-sentence where the key should
follow. Scored by exact match of the digits in the greedy continuation, unquantized
baseline and quantized cache alike (`haystack.run_retrieval`).
"""

from __future__ import annotations

import random

from kvq.eval.tasks.haystack import Probe, retrieval_task

NAME = "passkey"
# " 71432" is six tokens for a tokenizer that splits digits (Gemma, Llama 3); room for a
# period and a stray space
ANSWER_TOKENS = 10


def make_probe(rng: random.Random) -> Probe:
    key = str(rng.randrange(10_000, 100_000))
    return Probe(
        key=f"The pass key is {key}. Remember it. {key} is the pass key.",
        question="What is the pass key? The pass key is",
        answer=key,
    )


TASK = retrieval_task(NAME, make_probe, ANSWER_TOKENS)
