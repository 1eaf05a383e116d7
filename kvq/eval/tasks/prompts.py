"""Prompts for the generation tasks (decode, speculative): real text of an exact length.

A prompt starts where a sentence or a paragraph starts, so the model continues prose rather
than the middle of a word; wikitext's headings (" = = History = = ") and blank lines are
dropped first, since a continuation of a heading says little about long generation. Starts
are drawn with a seeded generator: the same text, tokenizer and seed give the same ids.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.runtime.prefix import user_tokens

MIN_PROMPT_TOKENS = 2  # BOS and one token of text: anything shorter conditions on nothing

_HEADING = re.compile(r"^\s*=.*=\s*$")  # wikitext headings: " = Title = ", " = = Sub = = "
# a sentence start: a paragraph's start, or an upper-case letter after a sentence's end
# and its space(s); wikitext spaces out its periods (" . "). No quotes: a quote after a
# period closes a sentence as often as it opens one.
_SENTENCE_START = re.compile(r"^|(?<=[.!?] )(?=[A-Z])|(?<=[.!?]  )(?=[A-Z])", re.M)
_CHARS_PER_TOKEN = 6  # generous: a slice this long almost always holds enough tokens
_SEAM = 4  # tokens past the prompt's end asked for: the slice may cut its last word short


def prompt_length(ctx, after: int, spec=None) -> int:
    """The prompt length for a task generating `after` tokens: min(--contexts), cut so
    that prompt + generation (after the cache's declared prefix `spec`, which the baseline
    runs too) fit the model's context; a KvqError if no prompt fits."""
    wanted = min(ctx.params.contexts)
    limit = ctx.loaded.adapter.max_positions
    room = None if limit is None else limit - after - (0 if spec is None else spec.length)
    if room is None or wanted <= room:
        return wanted
    if room < MIN_PROMPT_TOKENS:
        raise KvqError(
            f"--new-tokens {after} leaves no room for a prompt in the model's {limit}-token context"
        )
    return room


def served(ids: Tensor, spec, bos: int | None) -> tuple[Tensor, Tensor]:
    """(baseline ids, quantized ids) for prompts ids [B, T]: a cache with a declared prefix
    (IntactKV, PrefixQuant) serves its rows before the ids it gets, so the baseline runs
    the prefix's tokens and then the same user tokens. Without one both are `ids`."""
    if spec is None:
        return ids, ids
    user = user_tokens(ids, spec, bos)  # [B, T'] a leading BOS goes when the prefix has it
    prefix = torch.tensor(spec.token_ids, dtype=ids.dtype, device=ids.device)
    return torch.cat([prefix.expand(ids.shape[0], -1), user], dim=1), user  # [B, P + T']


def draw_prompts(tokenizer, text: str, n: int, length: int, seed: int) -> Tensor:
    """[n, length] int64 ids: n distinct passages of `text`, each starting at a sentence
    start, BOS first when the tokenizer has one (as the model saw text in training)."""
    if length < MIN_PROMPT_TOKENS:
        raise KvqError(f"prompts need at least {MIN_PROMPT_TOKENS} tokens, got {length}")
    body = _prose(text)
    starts = [m.end() for m in _SENTENCE_START.finditer(body)]
    bos = getattr(tokenizer, "bos_token_id", None)
    want = length - (bos is not None)  # tokens of text per prompt
    order = torch.randperm(len(starts), generator=torch.Generator().manual_seed(seed))
    rows: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for i in order.tolist():
        ids = _tokens_from(tokenizer, body, starts[i], want)
        if ids is None or tuple(ids) in seen:  # too near the end, or a repeated passage
            continue
        seen.add(tuple(ids))
        rows.append(([bos] if bos is not None else []) + ids)
        if len(rows) == n:
            return torch.tensor(rows, dtype=torch.int64)
    raise KvqError(
        f"the text holds only {len(rows)} distinct passages of {length} tokens starting at a "
        f"sentence, {n} prompts requested"
    )


def _prose(text: str) -> str:
    """The text without its headings and blank lines (paragraphs stay one per line)."""
    lines = (line.strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line and not _HEADING.match(line))


def _tokens_from(tokenizer, body: str, start: int, want: int) -> list[int] | None:
    """The first `want` token ids of body[start:], or None when the rest is too short.
    Only a slice is tokenized: its last word may be cut and tokenize otherwise, so a few
    tokens more than needed are asked for and dropped."""
    span = _CHARS_PER_TOKEN * (want + _SEAM) + 64
    while True:
        piece = body[start : start + span]
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        if len(ids) >= want + _SEAM:
            return ids[:want]
        if start + span >= len(body):
            return None
        span *= 2
