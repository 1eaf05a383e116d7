"""The family table: every family kvq takes, through the commands a user types, plus
families it has no entry for and the ones it refuses.

For each tested family a tiny random model (tests/conftest.py's shapes; its output layer
scaled x10 and its q.k logits x9, so that next-token and attention distributions are
peaked and K/V errors show in the figures) is saved with the tiny tokenizer, then `kvq calibrate kvquant --bits 4` (1 %
outliers, 1 sink token, no Fisher pass) and `kvq run-eval` (ppl, kld, bytes) run as
subprocesses, as a user runs them. Families without an entry go through `kvq.load_model`
and a greedy `model.generate` with an fp16 kvq cache against DynamicCache; refused ones
report their one-line reason.

    python bench/families.py [--windows 4] [--seqlen 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import CALIBRATION, SHARED  # noqa: E402

from tests.conftest import FAMILY_CONFIGS, make_tiny_model, tiny_tokenizer  # noqa: E402
from tests.models.test_families import (  # noqa: E402
    DERIVED_REFUSED,
    DERIVED_WORK,
    REFUSED,
    _unlisted,
)

FAMILIES = ["llama", "mistral", "qwen2", "gemma3", *FAMILY_CONFIGS]
KVQ = [sys.executable, "-m", "kvq"]


def _peaked(model):
    """Output layer x10 and q.k logits x9 (q and k x3 where they are produced: the
    projections' rows, or the q/k norms' weights), so that a random model's next-token and
    attention distributions are peaked and K/V errors show in the figures."""
    from kvq.models.adapters import get_adapter

    adapter = get_adapter(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)
        off = 1.0 if adapter.qk_norm_offset_one else 0.0
        for i in range(adapter.num_layers):
            for which in ("q", "k"):
                if adapter.qk_norm:
                    w = getattr(adapter.attention(i), f"{which}_norm").weight
                    w.copy_((off + w) * 3.0 - off)
                else:
                    proj, rows = adapter._projection_rows(i, which)
                    proj.weight[rows] *= 3.0
                    if proj.bias is not None:
                        proj.bias[rows] *= 3.0
    return model


def _save(model, where: Path) -> Path:
    model.save_pretrained(where)
    tiny_tokenizer().save_pretrained(where)
    return where


def _kvq(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVQ_DATA_DIR=str(SHARED))
    return subprocess.run([*KVQ, *map(str, args)], capture_output=True, text=True, env=env)


def tested_row(family: str, tmp: Path, windows: int, seqlen: int) -> dict:
    model_dir = _save(_peaked(make_tiny_model(family)), tmp / family)
    art, report = tmp / f"{family}-art", tmp / f"{family}.json"
    cal = _kvq("calibrate", "kvquant", "--model", model_dir, "--dataset", CALIBRATION,
               "--samples", 4, "--seqlen", seqlen, "--bits", 4, "--no-fisher", "--out", art)  # fmt: skip
    if cal.returncode:
        return {"family": family, "works": False, "error": cal.stderr.strip().splitlines()[-1]}
    ev = _kvq("run-eval", "--model", model_dir, "--artifact", art, "--windows", windows,
              "--seqlen", seqlen, "--tasks", "ppl,kld,bytes", "--json", report)  # fmt: skip
    if ev.returncode:
        return {"family": family, "works": False, "error": ev.stderr.strip().splitlines()[-1]}
    tasks = json.loads(report.read_text())["tasks"]
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    return {
        "family": family, "model_type": model_type, "works": True,
        "ppl_ratio": tasks["ppl"]["ratio"], "kld": tasks["kld"]["mean"],
        "top1": tasks["kld"]["top1_agreement"], "bytes_ratio": tasks["bytes"]["ratio"],
    }  # fmt: skip


@torch.no_grad()
def unlisted_row(model_type: str, tmp: Path) -> dict:
    import kvq

    where = _save(_unlisted(model_type).eval(), tmp / model_type)
    try:
        model, _ = kvq.load_model(str(where))
    except kvq.KvqError as e:
        return {"model_type": model_type, "works": False, "reason": str(e)}
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    same = torch.equal(
        model.generate(ids, cache=kvq.make_cache(model, policy="fp16"), **kw),
        model.generate(ids, **kw),
    )
    return {"model_type": model_type, "works": True, "fp16_greedy_equals_dynamic": same}


def refused_row(model_type: str) -> dict:
    from transformers import AutoConfig

    from kvq.errors import KvqError
    from kvq.models.families import check_architecture

    try:
        check_architecture(AutoConfig.for_model(model_type))
    except KvqError as e:
        return {"model_type": model_type, "reason": str(e)}
    return {"model_type": model_type, "reason": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tested = [tested_row(f, tmp, args.windows, args.seqlen) for f in FAMILIES]
        unlisted = [unlisted_row(m, tmp) for m in [*DERIVED_WORK, *DERIVED_REFUSED]]
    refused = [refused_row(m) for m in REFUSED]
    print(f"tested families: kvquant NUQ4 (1 % outliers, sink 1), run-eval "
          f"{args.windows} x {args.seqlen} WikiText-2, tiny random models (output x10, q.k x9)")  # fmt: skip
    print("| family | model_type | ppl ratio | KLD | top-1 | bytes vs fp16 |")
    print("|---|---|---|---|---|---|")
    for r in tested:
        if r["works"]:
            print(f"| {r['family']} | {r['model_type']} | {r['ppl_ratio']:.4f} | {r['kld']:.2e} "
                  f"| {r['top1']:.4f} | {r['bytes_ratio']:.3f} |")  # fmt: skip
        else:
            print(f"| {r['family']} | | FAILED: {r['error']} | | | |")
    print("\nfamilies without an entry (derived adapter, verified on one forward):")
    for r in unlisted:
        what = (f"works; fp16 greedy = DynamicCache: {r['fp16_greedy_equals_dynamic']}"
                if r["works"] else f"refused: {r['reason']}")  # fmt: skip
        print(f"- {r['model_type']}: {what}")
    print("\nrefused from the config:")
    for r in refused:
        print(f"- {r['model_type']}: {r['reason']}")
    if args.json:
        payload = {"windows": args.windows, "seqlen": args.seqlen, "tested": tested,
                   "unlisted": unlisted, "refused": refused}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
