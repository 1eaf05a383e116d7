"""`kvq calibrate trellis` on tiny models: tables shared or per layer, mixed bits within the
budget, the cache through `generate` (the CLI: tests/cli/test_trellis_cli.py)."""

from dataclasses import replace

import pytest
import torch

from kvq.calibrators import trellis as trellis_pass
from kvq.calibrators.options import TrellisOptions
from kvq.calibrators.trellis import calibrate_trellis
from kvq.errors import KvqError
from kvq.models.adapters import get_adapter
from kvq.progress import Progress
from kvq.runtime.cache import build_cache
from tests.calibrators.test_vq import _fisher, _windows
from tests.conftest import make_tiny_model


@pytest.fixture(autouse=True)
def _small_fits(monkeypatch):
    monkeypatch.setattr(trellis_pass, "POOLED_ROWS", 256)  # seconds, not minutes


def test_shared_tables_are_one_per_side_and_width_and_calibration_is_deterministic():
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    opts = TrellisOptions(bits=2, window=8)
    pol, a = calibrate_trellis(model, ad, _windows(), opts, Progress(), _fisher(ad))
    _, b = calibrate_trellis(model, ad, _windows(), opts, Progress(), _fisher(ad))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert {(lp.key.format, lp.key.bits, lp.key.window) for lp in pol.layers} == {("trellis", 2, 8)}
    n = ad.info.num_layers
    for part in ("key", "value"):
        tables = [a[f"layers.{i}.{part}.trellis_table"] for i in range(n)]
        assert tables[0].shape == (256,) and tables[0].dtype == torch.float16
        assert all(torch.equal(t, tables[0]) for t in tables)
    assert not torch.equal(a["layers.0.key.trellis_table"], a["layers.0.value.trellis_table"])
    _, per_layer = calibrate_trellis(
        model, ad, _windows(), TrellisOptions(bits=2, window=8, tables="layer"), Progress(), None
    )
    assert not torch.equal(
        per_layer["layers.0.key.trellis_table"], per_layer["layers.1.key.trellis_table"]
    )


def test_mixed_bits_keep_each_sides_budget_and_favour_the_sensitive_layer():
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    fk, fv = _fisher(ad)
    fk[1] *= 1e4  # one very sensitive key layer
    # no exceptions, no static charge: exactly the uniform policy's code bits
    opts = TrellisOptions(bits=2, mixed="fisher", outliers=0.0, static_tokens=0)
    pol, tensors = calibrate_trellis(model, ad, _windows(), opts, Progress(), (fk, fv))
    keys = [lp.key.bits for lp in pol.layers]
    values = [lp.value.bits for lp in pol.layers]
    assert sum(keys) == sum(values) == 2 * len(keys)
    assert keys[1] == max(keys) == 3
    # a table per width that a layer-side takes, shared by the layers of that width
    for i, b in enumerate(keys):
        twin = keys.index(b)
        assert torch.equal(
            tensors[f"layers.{i}.key.trellis_table"], tensors[f"layers.{twin}.key.trellis_table"]
        )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_the_cache_generates_and_counts_a_shared_table_once(family):
    model = make_tiny_model(family)
    ad = get_adapter(model)
    pol, tensors = calibrate_trellis(
        model, ad, _windows(), TrellisOptions(bits=3), Progress(), _fisher(ad)
    )
    cache = build_cache(model, pol, tensors, ad, backend="reference")
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, 18)
    held = [layer.key_codec.static["trellis_table"] for layer in cache.layers]
    assert all(t is held[0] for t in held)  # one tensor for every layer's keys
    # the ledger counts it once: each layer alone counts its own (2 L tables, 2 distinct)
    alone = sum(layer.ledger_bytes()["qparams"] for layer in cache.layers)
    table = tensors["layers.0.key.trellis_table"].nbytes
    assert alone - cache.nbytes().qparams == (2 * ad.info.num_layers - 2) * table


def test_static_state_is_charged_to_the_code_bits_or_refused():
    """Tiny Gemma (1 KV head of 32): one layer-bit at 96 tokens is 32 x 96 / 8 = 384 bytes,
    exactly one side's state at window 6: a 64-level fp16 table and 4 x 32 fp16 weights."""
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    opts = TrellisOptions(bits=2, window=6, mixed="fisher", outliers=0.0, static_tokens=96)
    assert trellis_pass.static_bytes(opts, ad) == 384
    pol, tensors = calibrate_trellis(model, ad, _windows(), opts, Progress(), _fisher(ad))
    n = ad.info.num_layers
    assert sum(lp.key.bits for lp in pol.layers) == sum(lp.value.bits for lp in pol.layers)
    assert sum(lp.key.bits for lp in pol.layers) == 2 * n - 1  # one layer-bit paid
    assert tensors["layers.0.key.trellis_weight"].dtype == torch.float16
    assert float(tensors["layers.0.key.trellis_weight"].max()) == 1.0
    with pytest.raises(KvqError, match="raise --static-tokens"):  # 96 layer-bits at 1 token
        calibrate_trellis(
            model, ad, _windows(), replace(opts, static_tokens=1), Progress(), _fisher(ad)
        )


def test_options_refuse_windows_the_widths_do_not_divide():
    with pytest.raises(KvqError, match="--window"):
        TrellisOptions(bits=3, window=8)
    with pytest.raises(KvqError, match="widths 2, 3, 4"):
        TrellisOptions(bits=3, window=9, mixed="fisher")  # 9 is no multiple of 2 or 4
    assert TrellisOptions(bits=3, window=12, mixed="fisher").widths() == (2, 3, 4)
