"""The cache contract's figures on Gemma 3 270M (issue: cache contract, KIVI, saved state).

    python bench/cache_contract.py [--artifact artifacts/demo] [--windows 4] [--json OUT]
        [--only contract,padding,assisted,kivi,kivi-padding]

* contract: tests/runtime/test_contract.py's results per layout and family, and the same
  module run against transformers' `QuantizedCache` (quanto, 4 bits) for comparison;
* padding: next-token KL against full precision of the demo INT4 artifact for a batch of
  prompts run alone and left-padded together (equal within 5% is the target);
* kivi-padding: the same for KIVI-2/4 on every layer with prompts long enough to encode
  groups (KIVI's token groups are batch columns: padding shifts them);
* assisted: greedy output with the INT8 policy, plain and with assisted and prompt-lookup
  decoding (must be equal);
* kivi: KIVI-2/4 (G 32, R 128) beside transformers' `QuantizedCache` (quanto, INT2/INT4,
  group 32, residual 128) on Gemma's three global layers (the sliding ones stay fp16:
  QuantizedCache refuses sliding layers), decode protocol: prefill 384 tokens, then 128
  teacher-forced ones; perplexity ratio, KLD and K/V bytes per token of those layers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, QuantoQuantizedLayer

import kvq
from kvq.eval.quality import QualityTotals, _accumulate
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy, named_policy
from kvq.runtime.cache import build_cache

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
PREFILL, STEPS = 384, 128


def contract_figures() -> dict:
    """Run the contract module (kvq layouts, then QuantizedCache); outcomes per case."""
    import os
    import subprocess
    import sys
    import xml.etree.ElementTree as ET

    out: dict[str, dict[str, str]] = {}
    for label, extra in (("kvq", ["-k", "not hf-quanto"]), ("hf", ["-k", "hf-quanto"])):
        xml = Path(f"/tmp/kvq-contract-{label}.xml")
        env = dict(os.environ, KVQ_CONTRACT_HF="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "runtime" / "test_contract.py"), f"--junitxml={xml}", *extra]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, check=False)
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name")  # test_x[family-layout]
            test, param = name.split("[", 1)
            family, layout = param.rstrip("]").split("-", 1)
            kids = {c.tag for c in case}
            verdict = (
                "xfail" if "skipped" in kids and "xfail" in ET.tostring(case, "unicode")
                else "skip" if "skipped" in kids
                else "fail" if kids & {"failure", "error"}
                else "pass"
            )  # fmt: skip
            out.setdefault(f"{layout} / {family}", {})[test.removeprefix("test_")] = verdict
    table = {}
    for row, tests in sorted(out.items()):
        counts = {v: sum(1 for x in tests.values() if x == v) for v in set(tests.values())}
        table[row] = counts | {"failed": sorted(t for t, v in tests.items() if v == "fail")}
        print(f"{row:32s} {counts}", flush=True)
    return table


def _texts(n: int) -> list[str]:
    raw = (DATA / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    paras = [p.strip() for p in raw.split("\n") if len(p.strip()) > 200]
    return paras[:n]


@torch.no_grad()
def padding_figures(model, rows: list[torch.Tensor], make, pad_id: int) -> dict:
    """KL(fp || quantized) per real position, prompts alone vs left-padded together.

    rows: the prompts' token ids (different lengths); make: () -> a fresh kvq cache.
    """
    alone_kl, alone_n = 0.0, 0
    for ids in rows:
        base = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        lq = torch.log_softmax(model(ids[None], cache=make()).logits[0].float(), -1)
        alone_kl += (base.exp() * (base - lq)).sum().item()
        alone_n += ids.numel()
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :], mask[i, width - r.numel() :] = r, 1
    # positions as generate gives them: each sequence's first real token at position 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    quant = model(ids, attention_mask=mask, position_ids=pos, cache=make()).logits
    padded_kl = 0.0
    for i, r in enumerate(rows):
        base = torch.log_softmax(model(r[None]).logits[0].float(), -1)
        lq = torch.log_softmax(quant[i, width - r.numel() :].float(), -1)
        padded_kl += (base.exp() * (base - lq)).sum().item()
    unpadded, padded = alone_kl / alone_n, padded_kl / alone_n
    return {"prompts": len(rows), "tokens": alone_n, "kl_unpadded": unpadded,
            "kl_padded": padded, "relative_difference": abs(padded - unpadded) / unpadded}  # fmt: skip


def demo_padding(model, tok, artifact: Path) -> dict:
    """The demo INT4 artifact on 16 short prompts of different lengths."""
    # enough tokens that the rounding noise between any two batch shapes (a flipped INT4
    # code cascades through later layers) averages out
    prompts = [t[: 100 + 60 * (i % 8)] for i, t in enumerate(_texts(16))]
    rows = [tok(p, return_tensors="pt")["input_ids"][0] for p in prompts]
    return padding_figures(
        model, rows, lambda: kvq.make_cache(model, artifact=artifact), tok.pad_token_id
    )


def kivi_padding(model, tok) -> dict:
    """KIVI-2/4 (G 32, R 128, every layer) on 8 prompts of 200..480 tokens: long enough that
    groups are encoded, so padding's shift of the group boundaries shows (see issue 14)."""
    text = "\n".join(_texts(200))
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    rows = [ids[600 * i : 600 * i + 200 + 40 * i] for i in range(8)]
    out = {}
    for name in ("kivi2-g32-r128", "kivi4-g32-r128"):
        out[name] = padding_figures(
            model, rows, lambda n=name: kvq.make_cache(model, policy=n), tok.pad_token_id
        )
        print(name, json.dumps(out[name]), flush=True)
    return out


@torch.no_grad()
def assisted_figures(model, tok) -> dict:
    prompt = "The capital of France is Paris. The capital of France is"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    kw = dict(max_new_tokens=40, do_sample=False)
    greedy = model.generate(ids, cache=kvq.make_cache(model, policy="int8"), **kw)
    assisted = model.generate(
        ids, cache=kvq.make_cache(model, policy="int8"), assistant_model=model, **kw
    )
    lookup = model.generate(
        ids, cache=kvq.make_cache(model, policy="int8"), prompt_lookup_num_tokens=4, **kw
    )
    return {
        "new_tokens": greedy.shape[1] - ids.shape[1],
        "assisted_equals_greedy": bool(torch.equal(assisted, greedy)),
        "prompt_lookup_equals_greedy": bool(torch.equal(lookup, greedy)),
        "text": tok.decode(greedy[0, ids.shape[1] :]),
    }


def _global_layers(model) -> list[int]:
    return [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]


def _kvq_cache(model, name: str):
    loaded = model._kvq_loaded
    info = loaded.adapter.info
    kivi = named_policy(name, info.num_layers, info.head_dim).layers[0]
    fp = LayerPolicy(FULL_PRECISION, FULL_PRECISION)
    glob = set(_global_layers(model))
    layers = tuple(kivi if i in glob else fp for i in range(info.num_layers))
    return build_cache(model, CachePolicy(f"{name} (global)", layers), {}, loaded.adapter)


def _quanto_cache(model, bits: int):
    cfg = model.config
    glob = set(_global_layers(model))
    layers = [
        QuantoQuantizedLayer(nbits=bits, q_group_size=32, residual_length=128)
        if i in glob
        else DynamicSlidingWindowLayer(sliding_window=cfg.sliding_window)
        for i in range(cfg.num_hidden_layers)
    ]
    return Cache(layers=layers)


def _kvq_bytes(cache, layers: list[int], tokens: int) -> float:
    total = 0
    for i in layers:
        total += sum(cache.layers[i].ledger_bytes().values())
    return total / tokens


def _quanto_bytes(cache, layers: list[int], tokens: int) -> float:
    """Stored bytes of the quantized tensors (data, scales, shifts) and the residual."""

    total = 0
    for i in layers:
        layer = cache.layers[i]
        for q in (layer._quantized_keys, layer._quantized_values):
            total += _packed_nbytes(q)
        total += layer.keys.nbytes + layer.values.nbytes  # the fp residual
    return total / tokens


def _packed_nbytes(q) -> int:
    """Bytes of a quanto QTensor's storage, walking its inner tensors."""
    if torch.is_tensor(q) and not hasattr(q, "__tensor_flatten__"):
        return q.nbytes
    names, _ = q.__tensor_flatten__()
    return sum(_packed_nbytes(getattr(q, n)) for n in names)


@torch.no_grad()
def kivi_figures(model, windows: torch.Tensor) -> dict:
    """Decode protocol on each window [N, PREFILL + STEPS + 1]."""
    glob = _global_layers(model)
    configs = {
        "kvq kivi2": lambda: _kvq_cache(model, "kivi2-g32-r128"),
        "quanto int2": lambda: _quanto_cache(model, 2),
        "kvq kivi4": lambda: _kvq_cache(model, "kivi4-g32-r128"),
        "quanto int4": lambda: _quanto_cache(model, 4),
    }
    out = {}
    for name, make in configs.items():
        totals, nbytes, t0 = QualityTotals(), [], time.time()
        for w in windows:
            ids = w[None]
            base = model(ids, logits_to_keep=STEPS + 1).logits[0]  # [S + 1, V]
            cache = make()
            model(ids[:, :PREFILL], cache=cache, logits_to_keep=1)
            for t in range(PREFILL, PREFILL + STEPS):
                quant = model(ids[:, t : t + 1], cache=cache).logits[:, 0]
                _accumulate(totals, base[t - PREFILL][None].float(), quant.float(), ids[:, t + 1])
            tokens = PREFILL + STEPS
            fn = _kvq_bytes if name.startswith("kvq") else _quanto_bytes
            nbytes.append(fn(cache, glob, tokens))
        fp16 = 2 * 2 * model.config.num_key_value_heads * model.config.head_dim * len(glob)
        out[name] = {
            "ppl_base": totals.ppl_base(),
            "ppl_ratio": totals.ppl_quant() / totals.ppl_base(),
            "kld": totals.kl / totals.tokens,
            "top1_agree": totals.top1_agree / totals.tokens,
            "bytes_per_token": sum(nbytes) / len(nbytes),
            "fp16_bytes_per_token": fp16,
            "seconds": time.time() - t0,
        }
        print(name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default=str(ROOT / "artifacts" / "demo"))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--only", default="contract,padding,assisted,kivi")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict = {"model": "gemma3-270m"}
    parts = args.only.split(",")
    if "contract" in parts:
        result["contract"] = contract_figures()
    if set(parts) - {"contract"}:
        model, tok = kvq.load_model("gemma3-270m")
    if "padding" in parts:
        result["padding"] = demo_padding(model, tok, Path(args.artifact))
        print("padding", json.dumps(result["padding"]), flush=True)
    if "kivi-padding" in parts:
        result["kivi_padding"] = kivi_padding(model, tok)
    if "assisted" in parts:
        result["assisted"] = assisted_figures(model, tok)
        print("assisted", json.dumps(result["assisted"]), flush=True)
    if "kivi" in parts:
        text = "\n".join(_texts(400))
        ids = tok(text, return_tensors="pt")["input_ids"][0]
        span = PREFILL + STEPS + 1
        starts = torch.linspace(0, ids.numel() - span - 1, args.windows).long()
        windows = torch.stack([ids[s : s + span] for s in starts.tolist()])
        result["kivi"] = {"windows": args.windows, "prefill": PREFILL, "steps": STEPS}
        result["kivi"] |= kivi_figures(model, windows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
