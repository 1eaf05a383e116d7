"""`speculative`: how often are drafts accepted when the quantized cache takes part in
speculative decoding? Both figures are acceptance rates, accepted / drafted tokens.

quantized draft: the model itself, through the quantized cache, drafts DRAFT_K tokens
greedily; the unquantized model (its own DynamicCache) checks them in one forward and keeps
the longest matching prefix plus its own next token. A quantized cache that changes few
argmaxes drafts well: this is self-speculation with a cheap cache. The baseline drafts
through a DynamicCache with the same weights, 1.0 by construction: a check of the loop.

prompt lookup: transformers' prompt-lookup decoding, whose drafts are copied from earlier in
the sequence after a matching n-gram, verified by the model whose cache is the baseline or
the quantized one: does the quantized cache still confirm what the text repeats?

transformers 5 reports no acceptance from `generate(prompt_lookup_num_tokens=...)` (its
assisted loop keeps n_matches to itself), so both run in the small loop below: drafts from
transformers' own `PromptLookupCandidateGenerator`, verification and rollback as its
`_assisted_decoding` does them (the first forward runs prompt and draft together; rejected
tokens leave every cache through `crop(-n)`). Two differences, both for fixed lengths:
no stop at EOS, and no draft past --new-tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from kvq.errors import KvqError
from kvq.eval.tasks.base import EvalTask, TaskContext
from kvq.eval.tasks.prompts import draw_prompts, prompt_length, served
from kvq.models.placement import input_device

DRAFT_K = 4  # tokens drafted per round, by the quantized draft and by prompt lookup
LOOKUP_NGRAM = 2  # longest n-gram prompt lookup matches (transformers' default)


@dataclass
class Tally:
    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float | None:
        """Accepted / drafted; None when nothing was drafted (prompt lookup found no match)."""
        return self.accepted / self.drafted if self.drafted else None


def _record_past(cache) -> None:
    """Let every layer roll back: a sliding-window layer otherwise drops the rows before its
    window as soon as it appends, and a crop could not bring them back."""
    for layer in cache.layers:
        if hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()


def _matches(drafts: Tensor, verified: Tensor) -> int:
    """Length of the longest prefix of drafts [1, C] equal to verified [1, C + 1]."""
    agree = (drafts[0] == verified[0, : drafts.shape[1]]).int()  # [C]
    return int(agree.cumprod(0).sum())


def _verify(model, cache, pending: Tensor, drafts: Tensor) -> Tensor:
    """[1, C + 1] greedy tokens of the model after each of drafts [1, C], fed after the
    tokens its cache does not hold yet (pending [1, P]): one forward."""
    feed = torch.cat([pending, drafts], dim=1)  # [1, P + C]
    logits = model(feed, cache=cache, use_cache=True, logits_to_keep=drafts.shape[1] + 1).logits
    return logits.argmax(-1)  # [1, C + 1]


@torch.no_grad()
def draft_decode(
    model, target_ids: Tensor, draft_ids: Tensor, new_tokens: int, draft_cache, k: int
) -> tuple[Tensor, Tally]:
    """Greedy speculative decoding of new_tokens tokens: the model drafts through
    `draft_cache` after draft_ids [1, T'] and checks through a DynamicCache after target_ids
    [1, T] (T' < T only when the draft cache serves a declared prefix). Returns the new
    tokens [1, N] (the target's greedy continuation, whatever the draft) and the tally."""
    target_cache = DynamicCache(config=model.config)
    _record_past(target_cache)
    _record_past(draft_cache)
    tally, device = Tally(), target_ids.device
    # each cache holds every committed token but the tokens in its pending
    target_pending, draft_pending = target_ids, draft_ids  # [1, P]
    out = torch.empty(1, 0, dtype=torch.long, device=device)
    while out.shape[1] < new_tokens:
        drafts = []
        for _ in range(min(k, new_tokens - out.shape[1] - 1)):  # room for the target's token
            feed = draft_pending if not drafts else drafts[-1]
            logits = model(feed, cache=draft_cache, use_cache=True, logits_to_keep=1).logits
            drafts.append(logits[:, -1:].argmax(-1))  # [1, 1]
        drafts = torch.cat(drafts, dim=1) if drafts else out[:, :0]  # [1, C]
        c = drafts.shape[1]
        verified = _verify(model, target_cache, target_pending, drafts)  # [1, C + 1]
        m = _matches(drafts, verified)
        tally.drafted, tally.accepted = tally.drafted + c, tally.accepted + m
        new = verified[:, : m + 1]  # the accepted drafts, then the target's own token
        out = torch.cat([out, new], dim=1)
        target_cache.crop(-(c - m))  # crop(0) too: a sliding layer shrinks back to its window
        target_pending = new[:, -1:]
        if not c:  # the draft did not run: it still lacks its pending tokens and this one
            draft_pending = torch.cat([draft_pending, new], dim=1)
        elif m == c:  # every draft kept: the draft cache lacks the last draft's row
            draft_cache.crop(0)
            draft_pending = torch.cat([drafts[:, -1:], new[:, -1:]], dim=1)
        else:  # it holds drafts[:c - 1]: the rejected ones go
            draft_cache.crop(-(c - 1 - m))
            draft_pending = new[:, -1:]
    return out, tally


@torch.no_grad()
def lookup_decode(model, ids: Tensor, new_tokens: int, cache, k: int) -> tuple[Tensor, Tally]:
    """Greedy prompt-lookup decoding of new_tokens tokens after ids [1, T] through `cache`:
    drafts of up to k tokens from transformers' PromptLookupCandidateGenerator (an n-gram
    match anywhere earlier in the sequence), checked by the model. Returns the new tokens
    [1, N] and the tally."""
    length = ids.shape[1] + new_tokens
    lookup = PromptLookupCandidateGenerator(
        num_output_tokens=k, max_matching_ngram_size=LOOKUP_NGRAM, max_length=length
    )
    _record_past(cache)
    tally, seq, pending = Tally(), ids, ids  # seq [1, S]: prompt and accepted tokens
    while seq.shape[1] < length:
        candidates, _ = lookup.get_candidates(seq)  # [1, S + C]: seq itself when no match
        drafts = candidates[:, seq.shape[1] :][:, : length - seq.shape[1] - 1]  # [1, C]
        c = drafts.shape[1]
        verified = _verify(model, cache, pending, drafts)  # [1, C + 1]
        m = _matches(drafts, verified)
        tally.drafted, tally.accepted = tally.drafted + c, tally.accepted + m
        new = verified[:, : m + 1]
        seq = torch.cat([seq, new], dim=1)
        cache.crop(-(c - m))
        pending = new[:, -1:]
    return seq[:, ids.shape[1] :], tally


RUNS = ("draft_base", "draft_quant", "lookup_base", "lookup_quant")


def _runs(ctx: TaskContext, target: Tensor, user: Tensor, n: int):
    """Yield (run, tally) of one prompt for each of RUNS: target [1, T] the baseline's ids,
    user [1, T'] the quantized cache's (without the tokens of its declared prefix)."""
    model = ctx.model

    def exact(decode, *ids: Tensor):  # the run through transformers' own cache
        def compute() -> dict:
            return asdict(decode(model, *ids, n, DynamicCache(config=model.config), DRAFT_K)[1])

        return compute

    params = {"new_tokens": n, "draft_k": DRAFT_K}
    tally = ctx.baseline("speculative/draft", target, params, exact(draft_decode, target, target))
    yield "draft_base", Tally(**tally)

    def quantized(decode, *ids: Tensor):  # the run through a fresh quantized cache
        def compute() -> dict:
            return asdict(decode(model, *ids, n, ctx.make_cache(), DRAFT_K)[1])

        return compute

    tally = ctx.quantized("speculative/draft", user, params, quantized(draft_decode, target, user))
    yield "draft_quant", Tally(**tally)
    tally = ctx.baseline("speculative/lookup", target, params, exact(lookup_decode, target))
    yield "lookup_base", Tally(**tally)
    tally = ctx.quantized("speculative/lookup", user, params, quantized(lookup_decode, user))
    yield "lookup_quant", Tally(**tally)


def _rate(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


@torch.no_grad()
def run(ctx: TaskContext) -> dict:
    p = ctx.params
    if p.new_tokens < 1:
        raise KvqError(
            f"--new-tokens must be at least 1 for the speculative task, got {p.new_tokens}"
        )
    model, n = ctx.model, p.new_tokens
    spec = ctx.make_cache().policy.prefix  # declared prefix rows the baseline runs as tokens
    length = prompt_length(ctx, n, spec)
    ids = draw_prompts(ctx.tokenizer, ctx.text, p.prompts, length, p.seed)  # [P, L]
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    base_ids, quant_ids = served(ids.to(input_device(model)), spec, bos)
    tallies = {key: Tally() for key in RUNS}
    with ctx.progress.stage("speculative", total=len(RUNS) * p.prompts) as bar:
        for i in range(p.prompts):
            target, user = base_ids[i : i + 1], quant_ids[i : i + 1]  # [1, T], [1, T']
            for key, tally in _runs(ctx, target, user, n):
                tallies[key].drafted += tally.drafted
                tallies[key].accepted += tally.accepted
                bar.advance()
    t = tallies
    return {
        "params": p.as_dict(),
        "cache": ctx.cache_name,
        "prompt_tokens": length,
        "draft_k": DRAFT_K,
        "quantized_draft": {
            "baseline_acceptance": _rate(t["draft_base"].rate),
            "quantized_acceptance": _rate(t["draft_quant"].rate),
            "drafted": t["draft_quant"].drafted,
            "accepted": t["draft_quant"].accepted,
        },
        "prompt_lookup": {
            "baseline_acceptance": _rate(t["lookup_base"].rate),
            "quantized_acceptance": _rate(t["lookup_quant"].rate),
            "baseline_drafted": t["lookup_base"].drafted,
            "quantized_drafted": t["lookup_quant"].drafted,
        },
    }


def _shown(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.3f}"


def summary(section: dict) -> list[tuple[str, str, str]]:
    k = section["draft_k"]
    rows = []
    for key, label in (
        ("quantized_draft", f"speculative acceptance, quantized draft (k={k})"),
        ("prompt_lookup", f"prompt-lookup acceptance (k={k})"),
    ):
        s = section[key]
        rows.append((label, _shown(s["baseline_acceptance"]), _shown(s["quantized_acceptance"])))
    return rows


TASK = EvalTask(name="speculative", run=run, summary=summary)
