"""`needle`: recall the number a fact in a haystack of the dataset's text gives a name.

A needle-in-a-haystack probe in the style of RULER's single-key task: one sentence ties a
random two-word name to a random 7-digit number, and the question asks for that name's
number. Unlike the pass key, the needle is stated once and must be found by its name.
Scored by exact match of the digits in the greedy continuation (`haystack.run_retrieval`).
"""

from __future__ import annotations

import random

from kvq.eval.tasks.haystack import Probe, retrieval_task

NAME = "needle"
# a space and seven digits for a tokenizer that splits digits, and room to spare
ANSWER_TOKENS = 12
# names are "adjective-noun" pairs (400 of them): not words the haystack would contain
_ADJECTIVES = (
    "amber", "brisk", "cobalt", "dusty", "eager", "frosty", "gentle", "hollow", "ivory",
    "jolly", "lunar", "misty", "nimble", "olive", "quiet", "rustic", "silver", "tidy",
    "velvet", "wooden",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "canyon", "dragon", "falcon", "garden", "harbor", "island", "jungle",
    "kettle", "lantern", "meadow", "orchard", "pepper", "quarry", "river", "saddle", "tunnel",
    "violin", "willow",
)  # fmt: skip


def make_probe(rng: random.Random) -> Probe:
    name = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    number = str(rng.randrange(1_000_000, 10_000_000))
    return Probe(
        key=f"The special magic number for {name} is {number}.",
        question=f"What is the special magic number for {name}? "
        f"The special magic number for {name} is",
        answer=number,
    )


TASK = retrieval_task(NAME, make_probe, ANSWER_TOKENS)
