"""Text sources (wikitext2, txt, jsonl, parquet) and reproducible token windows."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kvq.data.text import TextSource, load_text
from kvq.data.windows import TokenWindows, ids_fingerprint, sample_windows
from kvq.errors import KvqError
from tests.conftest import tiny_tokenizer

WIKITEXT_SHA = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"
SAMPLE = "Keys are cached per layer.\nValues too, one row per token.\n" * 400


@pytest.fixture(scope="module")
def sample():
    return SAMPLE, TextSource(spec="inline", path=None, sha256="0" * 64)


def test_wikitext2_from_data_dir(shared_data, monkeypatch):
    monkeypatch.delenv("KVQ_DATA_DIR", raising=False)
    text, source = load_text("wikitext2", data_dir=str(shared_data))
    assert source.sha256 == WIKITEXT_SHA  # byte-exact: the stray \r in the file survive
    assert source.path.endswith("wikitext-2-raw/wiki.test.raw")
    assert text.startswith(" = Robert Boulter = ")


def test_wikitext2_from_env(shared_data, monkeypatch):
    monkeypatch.setenv("KVQ_DATA_DIR", str(shared_data))
    assert load_text("wikitext2")[1].sha256 == WIKITEXT_SHA


def test_wikitext2_missing_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KVQ_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))  # an empty datasets cache
    with pytest.raises(KvqError, match="wikitext2 not found") as err:
        load_text("wikitext2", data_dir=str(tmp_path))
    assert "\n" not in str(err.value)


def test_txt_jsonl_parquet(tmp_path):
    rows = ["first document", "second document\n", "third"]
    expected = "first document\nsecond document\nthird\n"
    (tmp_path / "a.txt").write_text(expected, encoding="utf-8")
    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": r, "id": i}) for i, r in enumerate(rows)) + "\n\n"
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": rows, "n": [1, 2, 3]}), tmp_path / "a.parquet")
    digest = hashlib.sha256(expected.encode()).hexdigest()
    for name in ("a.txt", "a.jsonl", "a.parquet"):
        text, source = load_text(str(tmp_path / name))
        assert text == expected, name
        assert source.sha256 == digest and source.path == str(tmp_path / name)


def test_file_errors(tmp_path):
    with pytest.raises(KvqError, match="does not exist"):
        load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(KvqError, match=r"\.txt, \.jsonl, \.parquet"):
        load_text(str(tmp_path / "a.csv"))
    (tmp_path / "empty.txt").write_text(" \n\n")
    with pytest.raises(KvqError, match="no text"):
        load_text(str(tmp_path / "empty.txt"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(KvqError, match=r"bad.jsonl:2"):
        load_text(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(KvqError, match="not UTF-8"):
        load_text(str(tmp_path / "bin.txt"))


def test_windows_shape_bos_and_determinism(sample):
    tok = tiny_tokenizer()
    text, source = sample
    w = sample_windows(tok, text, source, n=4, seqlen=32, seed=0)
    assert isinstance(w, TokenWindows) and w.source is source and w.seed == 0
    assert w.ids.shape == (4, 32) and w.ids.dtype == torch.int64
    assert (w.ids[:, 0] == tok.bos_token_id).all()
    assert (w.ids[:, 1:] != tok.bos_token_id).all()  # no special tokens inside the text
    again = sample_windows(tok, text, source, n=4, seqlen=32, seed=0)
    assert torch.equal(w.ids, again.ids) and w.fingerprint == again.fingerprint
    other = sample_windows(tok, text, source, n=4, seqlen=32, seed=1)
    assert not torch.equal(w.ids, other.ids) and w.fingerprint != other.fingerprint
    assert w.fingerprint == ids_fingerprint(w.ids)


def test_windows_are_disjoint_chunks_in_text_order(sample):
    tok = tiny_tokenizer()
    text = "".join(f"Line {i} holds {i * 7919 % 10007}.\n" for i in range(400))  # no repeats
    source = sample[1]
    stream = tok(text, add_special_tokens=False).input_ids
    w = sample_windows(tok, text, source, n=5, seqlen=17, seed=3)
    starts = []
    for row in w.ids[:, 1:].tolist():
        idx = next(i for i in range(0, len(stream), 16) if stream[i : i + 16] == row)
        starts.append(idx)
    assert starts == sorted(starts) and len(set(starts)) == 5


def test_windows_without_bos(sample):
    tok = tiny_tokenizer()
    no_bos = type(tok)(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>")
    assert no_bos.bos_token_id is None
    w = sample_windows(no_bos, *sample, n=2, seqlen=16, seed=0)
    assert w.ids.shape == (2, 16)
    assert (w.ids != tok.bos_token_id).all()


def test_windows_errors(sample):
    tok = tiny_tokenizer()
    with pytest.raises(KvqError, match="positive"):
        sample_windows(tok, *sample, n=0, seqlen=16, seed=0)
    with pytest.raises(KvqError, match="at least 2"):
        sample_windows(tok, *sample, n=1, seqlen=1, seed=0)
    with pytest.raises(KvqError, match=r"only \d+ windows of 4096 tokens available, 8 requested"):
        sample_windows(tok, *sample, n=8, seqlen=4096, seed=0)


def test_wikitext2_windows(shared_data):
    text, source = load_text("wikitext2", data_dir=str(shared_data))
    w = sample_windows(tiny_tokenizer(), text, source, n=8, seqlen=128, seed=0)
    assert w.ids.shape == (8, 128) and w.source.sha256 == WIKITEXT_SHA
