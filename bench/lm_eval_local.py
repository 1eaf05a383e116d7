"""lm-evaluation-harness through the kvq cache on local tasks: baseline beside each cache.

No hub here, so the tasks are built from the shared WikiText-2 test text into a temporary
folder (never into the repository):
- `kvq_wiki_lastword`: LAMBADA-style. A paragraph's last word is the target, the words
  before it the context (loglikelihood: accuracy of the greedy word, its perplexity);
- `kvq_wiki_rolling`: whole paragraphs scored by rolling loglikelihood (word perplexity,
  bits per byte), lm-eval's own windowing at --max-length.

Each run is `lm_eval.simple_evaluate(model="kvq", model_args=...)`, the path a user takes
(`python -m kvq.integrations.lm_eval --model kvq ...` is the same call):

    python bench/lm_eval_local.py --artifact demo=artifacts/demo --policies int8,kivi2 \\
        --items 200 --json bench/results/cpu/lm_eval_local.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path

DATA = Path(os.environ.get("KVQ_DATA_DIR", Path(__file__).resolve().parents[2] / "shared/data"))
HEADING = re.compile(r"^\s*=.*=\s*$")

LASTWORD = """task: kvq_wiki_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: " {{{{target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

ROLLING = """task: kvq_wiki_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def paragraphs(text: str, min_words: int) -> list[str]:
    """WikiText paragraphs (no headings) of at least min_words words."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not HEADING.match(line) and len(line.split()) >= min_words:
            out.append(line)
    return out


def build_tasks(folder: Path, items: int, rolling: int, seed: int) -> None:
    text = (DATA / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    pool = paragraphs(text, 40)
    rng = random.Random(seed)
    picked = rng.sample(pool, items + rolling)
    last = []
    for p in picked[:items]:
        words = p.split()
        # wikitext ends paragraphs with " ." : the target is the last real word
        while words and not re.search(r"\w", words[-1]):
            words.pop()
        last.append({"context": " ".join(words[:-1]), "target": words[-1]})
    with open(folder / "lastword.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in last)
    with open(folder / "rolling.jsonl", "w") as f:
        f.writelines(json.dumps({"page": p}) + "\n" for p in picked[items:])
    (folder / "lastword.yaml").write_text(LASTWORD.format(data=folder / "lastword.jsonl"))
    (folder / "rolling.yaml").write_text(ROLLING.format(data=folder / "rolling.jsonl"))


def run(model: str, extra: str | None, folder: Path, max_length: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvq.integrations.lm_eval  # noqa: F401  (registers the "kvq" model type)

    args = f"pretrained={model},max_length={max_length}" + (f",{extra}" if extra else "")
    began = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model="kvq",
        model_args=args,
        tasks=["kvq_wiki_lastword", "kvq_wiki_rolling"],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        device="cpu",
        verbosity="ERROR",
    )
    res = out["results"]
    lw, ro = res["kvq_wiki_lastword"], res["kvq_wiki_rolling"]
    return {
        "model_args": args,
        "lastword_acc": lw["acc,none"],
        "lastword_acc_stderr": lw.get("acc_stderr,none"),
        "lastword_ppl": lw["perplexity,none"],
        "word_perplexity": ro["word_perplexity,none"],
        "bits_per_byte": ro["bits_per_byte,none"],
        "seconds": round(time.perf_counter() - began, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--artifact", action="append", default=[], help="NAME=DIR, repeatable")
    ap.add_argument("--policies", default="int8", help="comma list of policy names")
    ap.add_argument("--items", type=int, default=200, help="last-word items")
    ap.add_argument("--rolling", type=int, default=20, help="paragraphs scored whole")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import datasets

    runs = {"baseline": None}
    runs |= {p: f"policy={p}" for p in args.policies.split(",") if p}
    for spec in args.artifact:
        name, path = spec.split("=", 1)
        runs[name] = f"artifact={path}"
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        datasets.config.HF_DATASETS_CACHE = str(folder / "datasets")
        build_tasks(folder, args.items, args.rolling, args.seed)
        for name, extra in runs.items():
            rows[name] = run(args.model, extra, folder, args.max_length)
            r = rows[name]
            print(f"{name:12s} last-word acc {r['lastword_acc']:.4f} ppl {r['lastword_ppl']:.3f}"
                  f"  rolling word-ppl {r['word_perplexity']:.4f} bpb {r['bits_per_byte']:.5f}"
                  f"  ({r['seconds']} s)", flush=True)  # fmt: skip
    base = rows["baseline"]
    print("\n| cache | last-word acc | last-word ppl | word ppl (ratio) | bits/byte |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        ratio = r["word_perplexity"] / base["word_perplexity"]
        print(f"| {name} | {r['lastword_acc']:.4f} | {r['lastword_ppl']:.3f} | "
              f"{r['word_perplexity']:.4f} ({ratio:.4f}) | {r['bits_per_byte']:.5f} |")  # fmt: skip
    if args.json:
        payload = {
            "model": args.model,
            "items": args.items,
            "rolling": args.rolling,
            "max_length": args.max_length,
            "seed": args.seed,
            "data": str(DATA / "wikitext-2-raw" / "wiki.test.raw"),
            "runs": rows,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
