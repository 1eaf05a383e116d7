"""run-eval's passkey and needle tasks: token-exact prompts, the grid, the report, the plot."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch

import kvq
from kvq.errors import KvqError
from kvq.eval.tasks import get_task, needle, passkey
from kvq.eval.tasks.base import EvalParams, TaskContext
from kvq.eval.tasks.haystack import PromptBuilder, _sides, cell_prompts, sentences
from kvq.progress import Progress
from tests.conftest import tiny_tokenizer
from tests.eval.counting import CountingProgress

TASKS = {"passkey": passkey, "needle": needle}
CONTEXTS, DEPTHS, TRIALS = (128, 192), (0.0, 0.5, 1.0), 2  # tiny models: 256 positions

# short sentences: a key lands within a few tokens of the depth asked for
_ANIMALS = ("cat", "dog", "owl", "fox", "yak", "elk", "ant", "bee")
SHORT_TEXT = "\n".join(
    [" = Animals = ", ""]
    + [" ".join(f"The {a} saw {i}." for a in _ANIMALS) for i in range(40)]
    + [" = = More = = ", ""]
)


@pytest.fixture(scope="module")
def wikitext(shared_data) -> str:
    return (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """A tiny gemma3 loaded through kvq (model._kvq_loaded is its LoadedModel)."""
    model, _ = kvq.load_model(str(tiny_model_dir("gemma3")))
    return model


def _ctx(loaded, make_cache, text, progress=None, **params) -> TaskContext:
    grid = dict(contexts=CONTEXTS, depths=DEPTHS, trials=TRIALS) | params
    return TaskContext(
        loaded=loaded,
        make_cache=make_cache,
        cache_name="fp16",
        text=text,
        params=EvalParams(**grid),
        progress=progress or Progress(),
    )


def _find(ids: list[int], part: list[int]) -> list[int]:
    return [i for i in range(len(ids) - len(part) + 1) if ids[i : i + len(part)] == part]


def test_sentences_skip_headings_and_empty_lines():
    text = " = Title = \n\n A first one . A second ! Third ? \n = = Sub = = \n Last 1 @.@ 5 ."
    assert sentences(text) == ["A first one .", "A second !", "Third ?", "Last 1 @.@ 5 ."]


@pytest.mark.parametrize("name", TASKS)
def test_prompts_are_exactly_context_tokens(name, wikitext):
    builder = PromptBuilder(tiny_tokenizer(), wikitext, name)
    for context in (96, 128, 200):
        for depth in (0.0, 0.3, 0.5, 1.0):
            for prompt in cell_prompts(builder, TASKS[name].make_probe, context, depth, 3, 0):
                assert len(prompt.ids) == context
                assert prompt.ids[0] == tiny_tokenizer().bos_token_id
                assert prompt.ids.count(tiny_tokenizer().bos_token_id) == 1
                assert re.fullmatch(r"\d{5}" if name == "passkey" else r"\d{7}", prompt.answer)


@pytest.mark.parametrize("name", TASKS)
def test_the_key_sits_at_the_requested_depth(name):
    builder = PromptBuilder(tiny_tokenizer(), SHORT_TEXT, name)
    context = 256
    longest = max(len(builder.encode(" " + s)) for s in builder.sentences)
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        rng_probe = cell_prompts(builder, TASKS[name].make_probe, context, depth, 3, 7)
        for prompt in rng_probe:
            key = builder.encode(" " + _key_text(prompt.ids, prompt.answer))
            assert _find(prompt.ids, key) == [prompt.key_start]
            question = builder.encode("\n" + _question(name, prompt))
            q_start = context - len(question)
            assert prompt.ids[q_start:] == question
            start = len(builder.lead)  # the haystack spans [start, q_start) less the key
            budget = q_start - start - len(key)
            relative = (prompt.key_start - start) / budget
            assert abs(relative - depth) <= longest / budget, (depth, relative)
            if depth == 0.0:
                assert prompt.key_start == start
            if depth == 1.0:
                assert prompt.key_start + len(key) == q_start  # right before the question
            if depth > 0.0:  # the key follows a whole sentence
                before = tiny_tokenizer().decode(prompt.ids[start : prompt.key_start])
                assert before.endswith(".")


def _key_text(ids, answer) -> str:
    text = tiny_tokenizer().decode(ids)
    if re.search(rf"The pass key is {answer}\.", text):
        return f"The pass key is {answer}. Remember it. {answer} is the pass key."
    return re.search(rf"The special magic number for \S+ is {answer}\.", text).group()


def _question(name, prompt) -> str:
    if name == "passkey":
        return "What is the pass key? The pass key is"
    word = re.search(r"for (\S+) is", _key_text(prompt.ids, prompt.answer)).group(1)
    return f"What is the special magic number for {word}? The special magic number for {word} is"


def test_prompts_are_deterministic_per_seed_and_differ_between_trials(wikitext):
    builder = PromptBuilder(tiny_tokenizer(), wikitext, "passkey")

    def ids(seed, context=128, depth=0.5):
        return [p.ids for p in cell_prompts(builder, passkey.make_probe, context, depth, 4, seed)]

    assert ids(0) == ids(0)
    assert ids(0) != ids(1)
    assert ids(0) != ids(0, depth=0.0)
    first = ids(0)
    assert len({tuple(p) for p in first}) == 4
    # different haystack windows, not just different keys: the fillers differ
    windows = {tuple(p[1:20]) for p in ids(0, depth=1.0)}
    assert len(windows) == 4


def test_chat_template_wraps_the_prompt_as_a_user_message(wikitext):
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>user\n{{ m['content'] }}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
        "{% endif %}"
    )
    builder = PromptBuilder(tokenizer, wikitext, "passkey")
    assert builder.chat
    for depth in (0.0, 0.5, 1.0):
        for prompt in cell_prompts(builder, passkey.make_probe, 160, depth, 2, 0):
            assert len(prompt.ids) == 160
            assert prompt.ids.count(tokenizer.bos_token_id) == 1 and prompt.ids[0] == 2
            text = tokenizer.decode(prompt.ids)
            assert text.startswith("<bos><start_of_turn>user\n")
            assert text.endswith("The pass key is<end_of_turn>\n<start_of_turn>model\n")


@pytest.fixture(scope="module")
def fp16_sections(tiny, wikitext):
    """Each task run on the tiny model against an unquantized-equivalent cache."""
    out = {}
    for name in TASKS:
        progress = CountingProgress()
        ctx = _ctx(tiny._kvq_loaded, lambda: kvq.make_cache(tiny, policy="fp16"), wikitext,
                   progress)  # fmt: skip
        out[name] = (get_task(name).run(ctx), progress)
    return out


@pytest.mark.parametrize("name", TASKS)
def test_report_shape_and_progress(name, fp16_sections):
    section, progress = fp16_sections[name]
    assert section["task"] == name and section["cache"] == "fp16"
    assert section["params"]["contexts"] == list(CONTEXTS)
    assert section["params"]["depths"] == list(DEPTHS)
    assert section["params"]["trials"] == TRIALS
    assert section["params"]["prompt_format"] == "completion"
    cells = section["cells"]
    assert [(c["context"], c["depth"]) for c in cells] == [(c, d) for c in CONTEXTS for d in DEPTHS]
    for c in cells:
        assert c["trials"] == TRIALS
        assert 0 <= c["baseline_correct"] <= TRIALS and 0 <= c["quantized_correct"] <= TRIALS
    for key in ("baseline_accuracy", "quantized_accuracy", "max_cell_gap", "mean_cell_gap"):
        assert isinstance(section[key], (int, float))
    assert progress.totals == {name: len(cells)} and progress.advanced == len(cells)
    rows = get_task(name).summary(section)
    assert [r[0] for r in rows] == [f"{name} accuracy", f"{name} worst cell (trials lost)"]
    import json

    assert json.loads(json.dumps(section)) == section


@pytest.mark.parametrize("name", TASKS)
def test_lossless_cache_matches_the_baseline_in_every_cell(name, fp16_sections):
    """Both sides run the same prompts: with an fp16 cache the greedy continuations (not
    only the scores, which a random model leaves at 0) are the same text."""
    section, _ = fp16_sections[name]
    for c in section["cells"]:
        assert c["quantized_correct"] == c["baseline_correct"]
        assert c["agreeing"] == c["trials"]
    assert section["agreement"] == 1.0 and section["max_cell_gap"] == 0


def test_lossy_cache_is_really_in_the_loop(tiny, wikitext):
    ctx = _ctx(tiny._kvq_loaded, lambda: kvq.make_cache(tiny, policy="int2"), wikitext,
               contexts=(128,), depths=(0.5,))  # fmt: skip
    assert get_task("passkey").run(ctx)["agreement"] < 1.0


class OracleModel(torch.nn.Module):
    """Answers the key it reads in the prompt; with a cache, wrong on prompts of
    `wrong_at` tokens. Any other generate call is a failure when `refuse` is set."""

    def __init__(self, tokenizer, wrong_at: int, refuse: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)
        self.tokenizer, self.wrong_at, self.refuse = tokenizer, wrong_at, refuse

    def get_input_embeddings(self):
        return self.embed

    def generate(self, ids, attention_mask, do_sample, max_new_tokens, cache=None):
        assert not self.refuse, "generate ran before the refusal"
        assert attention_mask.shape == ids.shape and not do_sample
        news = []
        for row in ids.tolist():
            text = self.tokenizer.decode(row)
            answer = re.search(r"(?:pass key|for \S+) is (\d+)\.", text).group(1)
            if cache is not None and len(row) == self.wrong_at:
                answer = "0" * len(answer)
            news.append(self.tokenizer(f" {answer}.", add_special_tokens=False).input_ids)
        width = min(max(map(len, news)), max_new_tokens)
        pad = self.tokenizer.pad_token_id  # what generate appends after a finished row
        new = [(n + [pad] * width)[:width] for n in news]
        return torch.cat([ids, torch.tensor(new, dtype=ids.dtype)], dim=1)  # [B, T + width]


def _oracle_ctx(wikitext, wrong_at, refuse=False, **params):
    tok = tiny_tokenizer()
    model = OracleModel(tok, wrong_at, refuse)
    loaded = SimpleNamespace(model=model, tokenizer=tok, adapter=SimpleNamespace(max_positions=256))
    cache = SimpleNamespace(policy=SimpleNamespace(prefix=None))
    return _ctx(loaded, lambda: cache, wikitext, **params)


@pytest.mark.parametrize("name", TASKS)
def test_scores_count_exact_digit_matches_per_side(name, wikitext):
    section = get_task(name).run(_oracle_ctx(wikitext, wrong_at=192))
    for c in section["cells"]:
        assert c["baseline_correct"] == TRIALS
        assert c["quantized_correct"] == (0 if c["context"] == 192 else TRIALS)
    assert section["baseline_accuracy"] == 1.0 and section["quantized_accuracy"] == 0.5
    assert section["max_cell_gap"] == TRIALS and section["mean_cell_gap"] == TRIALS / 2
    assert get_task(name).summary(section) == [
        (f"{name} accuracy", "1.000", "0.500"),
        (f"{name} worst cell (trials lost)", "0", str(TRIALS)),
    ]


def test_heatmap_is_a_png_per_task(wikitext, tmp_path):
    section = get_task("needle").run(_oracle_ctx(wikitext, wrong_at=128))
    paths = get_task("needle").plot(section, tmp_path / "plots")
    assert paths == [tmp_path / "plots" / "needle_grid.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(contexts=(128, 512)), "asks for 522 tokens; the model's context is 256"),
        (dict(contexts=(250,)), "asks for 260 tokens"),  # the answer must fit too
        (dict(contexts=(48,)), "too short"),
        (dict(depths=(0.5, 1.5)), "depths must lie in"),
        (dict(trials=0), "trials must be at least 1"),
    ],
)
def test_bad_grids_are_refused_before_any_generation(wikitext, params, message):
    with pytest.raises(KvqError, match=message):
        get_task("passkey").run(_oracle_ctx(wikitext, wrong_at=0, refuse=True, **params))


def test_refuses_a_context_beyond_a_real_model(tiny, wikitext):
    ctx = _ctx(tiny._kvq_loaded, lambda: kvq.make_cache(tiny, policy="fp16"), wikitext,
               contexts=(512,))  # fmt: skip
    with pytest.raises(KvqError, match="the model's context is 256"):
        get_task("needle").run(ctx)


def test_a_declared_prefix_is_served_to_the_baseline_too():
    """IntactKV's prefix is the BOS: the cache gets the prompt without it, the baseline
    the BOS and the same tokens; the two sides see the same sequence."""
    ids = torch.tensor([[2, 5, 6, 7], [2, 8, 9, 10]])  # [B, T]
    spec = SimpleNamespace(token_ids=(2, 40), length=2)
    base, quant = _sides(ids, spec, bos=2)
    assert quant.tolist() == [[5, 6, 7], [8, 9, 10]]
    assert base.tolist() == [[2, 40, 5, 6, 7], [2, 40, 8, 9, 10]]
    assert _sides(ids, None, bos=2) == (ids, ids)
