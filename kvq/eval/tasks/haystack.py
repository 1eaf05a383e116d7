"""Synthetic retrieval (passkey, needle) cut from the dataset's own text.

A prompt is a haystack of real sentences with one key sentence inserted at a depth
d in [0, 1] (0: the haystack's start, 1: right before the question), then a question whose
answer is the key's digits. Every prompt is exactly `context` tokens: the pieces (lead,
sentences, key, question, tail) are tokenized separately and their ids joined, so the
length is counted, not guessed from text, and the trials of a grid cell stack into one
batch with no padding. Both sides of the comparison generate greedily from the same ids:
the unquantized model with transformers' own cache, then the model with a quantized cache.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq.errors import KvqError
from kvq.eval.tasks.base import EvalTask, TaskContext
from kvq.models.placement import input_device
from kvq.pipeline import check_context
from kvq.runtime.prefix import user_tokens

# wikitext headings look like " = Title = " / " = = Section = = "
_HEADING = re.compile(r"^=.*=$")
# a sentence ends at . ! or ? before whitespace (wikitext's decimal "1 @.@ 5" has none)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# placeholder for the user message when a chat template is split into head and tail
_MARK = "KVQHAYSTACKMARK"
# extra answer tokens when the prompt is a chat: an instruction-tuned model may open its
# reply with a few words ("The pass key is ...") before the digits
CHAT_SLACK = 8
# the EvalParams fields these tasks run under (the others size other tasks)
_PARAMS = ("contexts", "depths", "trials", "seed")


def sentences(text: str) -> list[str]:
    """The text's sentences, headings and empty lines skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or _HEADING.match(line):
            continue
        out.extend(s for s in _SENTENCE_END.split(line) if s)
    return out


@dataclass(frozen=True)
class Probe:
    """What one trial hides and asks: the model's continuation should hold `answer`."""

    key: str  # the sentence inserted into the haystack
    question: str  # asked after the haystack; ends where the answer should start
    answer: str  # the digits an exact match needs


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # exactly `context` token ids
    key_start: int  # index in `ids` of the key's first token
    answer: str


class PromptBuilder:
    """Builds token-exact prompts from a text's sentences for one tokenizer.

    With a chat template the haystack and question are the content of one user message
    (generation prompt added); otherwise the prompt is plain text to complete.
    """

    def __init__(self, tokenizer, text: str, what: str):
        self.tokenizer = tokenizer
        self.what = what  # the task name, for messages
        self.sentences = sentences(text)
        if not self.sentences:
            raise KvqError(f"{what}: the dataset has no sentences to build a haystack from")
        self._sentence_ids: dict[int, list[int]] = {}  # tokenized on first use
        self.lead, self.tail, self.chat = self._frame()

    def encode(self, piece: str) -> list[int]:
        return list(self.tokenizer(piece, add_special_tokens=False)["input_ids"])

    def _frame(self) -> tuple[list[int], list[int], bool]:
        """(ids before the haystack, ids after the question, whether it is a chat): the chat
        template's head and tail around the user message, else the BOS the tokenizer adds
        (if any) and nothing."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": _MARK}]
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            if text.count(_MARK) == 1:  # else a template that rewrites content: plain text
                head, tail = text.split(_MARK)
                # the template writes its BOS as text; encoding it gives the special id
                return self.encode(head), self.encode(tail), True
        first = self.tokenizer("a")["input_ids"][:1]
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return ([bos] if bos is not None and first == [bos] else []), [], False

    def _sentence(self, i: int) -> list[int]:
        if i not in self._sentence_ids:
            # a leading space: each sentence follows the one before as it would in text
            self._sentence_ids[i] = self.encode(" " + self.sentences[i])
        return self._sentence_ids[i]

    def build(self, probe: Probe, context: int, depth: float, offset: int) -> Prompt:
        """A prompt of exactly `context` tokens: the haystack is the sentences from index
        `offset` on (wrapping), cut at its start to fit, the key at the sentence boundary
        nearest `depth` of it."""
        key = self.encode(" " + probe.key)
        question = self.encode("\n" + probe.question)
        fixed = len(self.lead) + len(key) + len(question) + len(self.tail)
        budget = context - fixed  # haystack tokens
        if budget < 1:
            raise KvqError(
                f"{self.what}: a prompt needs more than {fixed} tokens; "
                f"context {context} is too short"
            )
        pieces, total, i = [], 0, offset
        while total < budget:
            pieces.append(self._sentence(i % len(self.sentences)))
            total += len(pieces[-1])
            i += 1
        cut = total - budget  # dropped from the start, so the haystack ends on a full sentence
        filler = [t for p in pieces for t in p][cut:]  # [budget]
        bounds, end = {0, budget}, -cut
        for p in pieces:
            end += len(p)
            if 0 < end < budget:
                bounds.add(end)
        target = depth * budget
        at = min(sorted(bounds), key=lambda b: abs(b - target))
        ids = self.lead + filler[:at] + key + filler[at:] + question + self.tail
        assert len(ids) == context, (len(ids), context)
        return Prompt(ids, len(self.lead) + at, probe.answer)


def cell_prompts(
    builder: PromptBuilder,
    make_probe: Callable[[random.Random], Probe],
    context: int,
    depth: float,
    trials: int,
    seed: int,
) -> list[Prompt]:
    """The trials of one (context, depth) cell: each its own key and haystack window. The
    generator is seeded by the cell's values, so a cell's prompts do not depend on the rest
    of the grid (a str seed is hashed deterministically, unlike hash())."""
    rng = random.Random(f"{builder.what}/{seed}/{context}/{depth}")
    prompts = []
    for _ in range(trials):
        probe = make_probe(rng)
        offset = rng.randrange(len(builder.sentences))
        prompts.append(builder.build(probe, context, depth, offset))
    return prompts


def is_correct(continuation: str, answer: str) -> bool:
    """Exact match: the continuation's first run of digits is the answer."""
    found = re.search(r"\d+", continuation)
    return found is not None and found.group() == answer


def _continuations(model, tokenizer, ids: torch.Tensor, new_tokens: int, cache) -> list[str]:
    """Greedy continuations of ids [B, T], decoded; cache None: transformers' default."""
    extra = {} if cache is None else {"cache": cache}
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        **extra,
    )  # [B, T + <= new_tokens]
    return tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def _sides(ids: torch.Tensor, spec, bos: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(baseline ids, quantized ids) for prompts ids [B, T]: a cache that declares a prefix
    (IntactKV, PrefixQuant) serves it before the ids it gets, so the baseline runs the
    prefix's tokens followed by the same user tokens."""
    if spec is None:
        return ids, ids
    user = user_tokens(ids, spec, bos)  # [B, T'] a leading BOS goes when the prefix has it
    prefix = torch.tensor(spec.token_ids, device=ids.device).expand(ids.shape[0], -1)
    return torch.cat([prefix, user], dim=1), user  # [B, P + T'], [B, T']


def _prefix_extra(spec, lead: list[int], bos: int | None) -> int:
    """Tokens a declared prefix adds to each prompt: its own, less the prompt's BOS when
    the prefix supplies it (`_sides`)."""
    if spec is None:
        return 0
    supplied = bos is not None and lead[:1] == [bos] and spec.token_ids[0] == bos
    return spec.length - int(supplied)


def _check_grid(ctx: TaskContext, name: str) -> None:
    p = ctx.params
    if not p.contexts or not p.depths:
        raise KvqError(f"{name} needs at least one context and one depth")
    if any(not 0.0 <= d <= 1.0 for d in p.depths):
        raise KvqError(f"{name}: depths must lie in [0, 1], got {list(p.depths)}")
    if p.trials < 1:
        raise KvqError(f"{name}: trials must be at least 1, got {p.trials}")


def run_retrieval(
    ctx: TaskContext,
    name: str,
    make_probe: Callable[[random.Random], Probe],
    answer_tokens: int,
) -> dict:
    """The task's report section over contexts x depths x trials (see the module doc)."""
    _check_grid(ctx, name)
    p = ctx.params
    builder = PromptBuilder(ctx.tokenizer, ctx.text, name)
    new_tokens = answer_tokens + (CHAT_SLACK if builder.chat else 0)
    spec = ctx.make_cache().policy.prefix  # a declared prefix is served on top
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    longest = max(p.contexts)
    served = longest + _prefix_extra(spec, builder.lead, bos) + new_tokens
    check_context(ctx.loaded, served, f"{name}: context {longest} + {new_tokens} answer tokens")
    grid = [(c, d) for c in p.contexts for d in p.depths]
    # every prompt first: a context too short for the key fails before any generation
    prompts = [cell_prompts(builder, make_probe, c, d, p.trials, p.seed) for c, d in grid]
    device = input_device(ctx.model)
    cells = []
    with torch.no_grad(), ctx.progress.stage(name, total=len(grid)) as bar:
        for (context, depth), cell in zip(grid, prompts, strict=True):
            ids = torch.tensor([q.ids for q in cell], device=device)  # [trials, context]
            base_ids, quant_ids = _sides(ids, spec, bos)
            base = ctx.baseline(
                f"{name}/continuations",
                base_ids,
                {"new_tokens": new_tokens},
                lambda ids=base_ids: _continuations(
                    ctx.model, ctx.tokenizer, ids, new_tokens, None
                ),
            )
            quant = ctx.quantized(
                f"{name}/continuations",
                quant_ids,
                {"new_tokens": new_tokens},
                lambda ids=quant_ids: _continuations(
                    ctx.model, ctx.tokenizer, ids, new_tokens, ctx.make_cache()
                ),
            )
            cells.append(_score(context, depth, cell, base, quant))
            bar.advance()
    return _section(ctx, name, builder, new_tokens, cells)


def _score(context: int, depth: float, cell: list[Prompt], base: list[str], quant: list[str]):
    """One cell's row: correct trials on each side, and trials whose two continuations
    are the same text (all of them for a lossless cache)."""
    answers = [q.answer for q in cell]
    return {
        "context": context,
        "depth": depth,
        "trials": len(cell),
        "baseline_correct": sum(map(is_correct, base, answers)),
        "quantized_correct": sum(map(is_correct, quant, answers)),
        "agreeing": sum(map(str.__eq__, base, quant)),
    }


def _section(ctx, name, builder, new_tokens, cells) -> dict:
    trials = sum(c["trials"] for c in cells)
    gaps = [c["baseline_correct"] - c["quantized_correct"] for c in cells]
    return {
        "task": name,
        "cache": ctx.cache_name,
        "params": {
            **{k: v for k, v in ctx.params.as_dict().items() if k in _PARAMS},
            "answer_tokens": new_tokens,
            "prompt_format": "chat" if builder.chat else "completion",
        },
        "cells": cells,
        "baseline_accuracy": sum(c["baseline_correct"] for c in cells) / trials,
        "quantized_accuracy": sum(c["quantized_correct"] for c in cells) / trials,
        "agreement": sum(c["agreeing"] for c in cells) / trials,
        "max_cell_gap": max(gaps),
        "mean_cell_gap": sum(gaps) / len(gaps),
    }


def summary_rows(name: str, section: dict) -> list[tuple[str, str, str]]:
    return [
        (
            f"{name} accuracy",
            f"{section['baseline_accuracy']:.3f}",
            f"{section['quantized_accuracy']:.3f}",
        ),
        (f"{name} worst cell (trials lost)", "0", str(section["max_cell_gap"])),
    ]


def plot_grid(name: str, section: dict, folder: Path) -> list[Path]:
    """A heatmap of quantized minus baseline accuracy per (context, depth) cell, both
    accuracies written in each cell: `{folder}/{name}_grid.png`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    cells = section["cells"]
    contexts = sorted({c["context"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    gap = torch.full((len(contexts), len(depths)), float("nan"))  # [contexts, depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(depths) + 2.5, 0.8 * len(contexts) + 1.8))
    for c in cells:
        r, k = contexts.index(c["context"]), depths.index(c["depth"])
        base, quant = c["baseline_correct"] / c["trials"], c["quantized_correct"] / c["trials"]
        gap[r, k] = quant - base
        ax.text(k, r, f"b {base:.2f}\nq {quant:.2f}", ha="center", va="center", fontsize=8)
    image = ax.imshow(gap.numpy(), cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto")
    fig.colorbar(image, ax=ax, label="quantized - baseline accuracy")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_xlabel("depth of the key (0 = start)")
    ax.set_ylabel("context (tokens)")
    cache = section.get("cache")
    ax.set_title(f"{name}" + (f" — {cache}" if cache else ""))
    fig.tight_layout()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}_grid.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def retrieval_task(name: str, make_probe: Callable[[random.Random], Probe], answer_tokens: int):
    """The registered task of a retrieval kind: what its module supplies is the probe."""
    return EvalTask(
        name=name,
        run=lambda ctx: run_retrieval(ctx, name, make_probe, answer_tokens),
        summary=lambda section: summary_rows(name, section),
        plot=lambda section, folder: plot_grid(name, section, folder),
    )
