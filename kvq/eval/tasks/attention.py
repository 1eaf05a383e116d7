"""`attention` task: attention-logit, attention-output and K/V reconstruction error per layer.

Article 0x0CC asks for attention error, not only element MSE. One prompt of real text
(min(--contexts) tokens, within the model's context) runs once through the unquantized
model with a transformers `DynamicCache`: its K and V (post-RoPE) are the exact rows, and
the capture hooks (`kvq.calibrators.capture`) give the exact queries, rotated at their
positions. The same K/V rows then go into a fresh quantized cache through its own append
path, as a forward hands them (`update`, the layer view's `prepare`, `attended`, which
publishes every layer at once), and each layer's committed rows are read back as the next
query would see them (`KvqLayer.visible_rows`: decoded rows, sink rows, residual rows,
pre-RoPE keys re-rotated; the declared prefix rows, if any, in front).

Both sides are then scored on the same rows: what the cache still holds. A sliding layer
holds only its last window after the prompt, so its figures cover the queries whose own row
it still holds, each over the rows of its window that remain. Queries attend causally with
the model's softmax scale and logit softcap; logits and outputs are float32 on both sides,
so the difference is the cache's alone.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache

from kvq.calibrators.capture import capture
from kvq.data.windows import text_token_ids
from kvq.errors import KvqError
from kvq.eval.tasks.base import EvalTask, TaskContext
from kvq.models.placement import input_device
from kvq.runtime.prefix import user_tokens

POSITION_BUCKETS = 8  # K/V error by position: equal slices of the prompt
RECENT_ROWS = 32  # most recent rows reported apart when the policy keeps no residual window
WORST_CHANNELS = 8
CHUNK_LOGITS = 1 << 24  # logits computed at once (per KV head): bounds memory at long contexts


# --- inputs ----------------------------------------------------------------------------


def _prompt(ctx: TaskContext, prefix) -> Tensor:
    """[1, T] token ids: BOS (when the tokenizer has one and the cache's declared `prefix`
    does not supply it), then the text's first tokens, T = min(--contexts) within the
    model's context."""
    want = min(ctx.params.contexts)
    limit = ctx.loaded.adapter.max_positions
    if limit is not None:
        want = min(want, limit - (0 if prefix is None else prefix.length))
    tok = ctx.tokenizer
    bos = getattr(tok, "bos_token_id", None)
    head = [] if bos is None else [bos]
    # tokenize a growing start of the text, not all of it (a dataset may be megabytes)
    chars = 8 * want
    while True:
        body = text_token_ids(tok, ctx.text[:chars])
        if len(head) + len(body) >= want or chars >= len(ctx.text):
            break
        chars *= 2
    ids = (head + list(body))[:want]
    if len(ids) < want or want < 2:
        raise KvqError(
            f"the attention task needs a prompt of {want} tokens, the dataset's text has "
            f"{len(head) + len(body)}"
        )
    return user_tokens(torch.tensor([ids]), prefix, bos)


@torch.no_grad()
def _reference(loaded, served: Tensor, queries_kept: int):
    """The unquantized forward over `served` [1, L]: per layer (K, V) as the model cached
    them ([1, H_kv, L, D], model dtype) and the last `queries_kept` queries post-RoPE
    ([H_q, Q, D] float32)."""
    adapter, model = loaded.adapter, loaded.model
    queries: dict[int, Tensor] = {}

    def keep(layer: int, _part: str, x: Tensor) -> None:  # x [1, H_q, L, D]
        queries[layer] = x[0, :, -queries_kept:].float()

    cache = DynamicCache()  # no config: sliding layers keep every row, as full ones do
    positions = torch.arange(served.shape[1])
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    with capture(adapter, keep, parts=("query",), key_stage="post-rope", positions=positions):
        body(input_ids=served.to(input_device(model)), cache=cache, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return kv, [queries[i] for i in range(len(kv))]


@torch.no_grad()
def _serve(cache, kv: list[tuple[Tensor, Tensor]], first: int) -> None:
    """Append the exact rows from position `first` on to `cache` the way a forward does:
    every layer's update and prepare, then `attended`, which publishes all layers at once."""
    for i, (key, value) in enumerate(kv):
        k, v = key[:, :, first:], value[:, :, first:]  # [1, H_kv, T, D]
        pos = torch.arange(first, first + k.shape[2], device=k.device)[None]  # [1, T]
        view, _ = cache.update(k, v, i, kwargs={"position_ids": pos})
        view.prepare(None)  # None: causal, nothing padded
        cache.attended(i)
    if cache.publications != 1:
        raise KvqError("the quantized cache did not publish the prompt's rows")


def _held(layer, prefix_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """What `layer` serves the next query: K post-RoPE and V [H_kv, C, D] float32 and each
    row's position [C] (prefix rows first, at 0 .. P-1; then the columns still held)."""
    st = layer.state
    k, v = layer.visible_rows(st)  # [1, H_kv, visible, D]
    device = k.device
    pos = prefix_len + st.evicted + torch.arange(k.shape[2], device=device)
    prefix = layer.prefix_rows(st)
    if prefix is not None:
        k, v = torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)
        pos = torch.cat([torch.arange(prefix[0].shape[2], device=device), pos])
    return k[0], v[0], pos


# --- errors ----------------------------------------------------------------------------


def _ratio(err: float, ref: float) -> float | None:
    return None if ref <= 0 else (err / ref) ** 0.5


def _rel_mse(err: float, ref: float) -> float | None:
    return None if ref <= 0 else err / ref


def _logits(q: Tensor, k: Tensor, scale: float, softcap: float | None) -> Tensor:
    s = q @ k.transpose(-1, -2) * scale  # [G, Q, C]
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def _mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """[Q, C] bool: causal, and within a sliding layer's window (incl. the query's own row)."""
    mask = k_pos[None] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None] > q_pos[:, None] - window
    return mask


def _attend(q, k, v, mask, scale: float, softcap: float | None) -> tuple[Tensor, Tensor]:
    """(logits [G, Q, C], output [G, Q, D]) of queries q [G, Q, D] over k, v [C, D]."""
    s = _logits(q, k, scale, softcap)
    return s, torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def _attention_sums(q, exact, served, q_pos, k_pos, scale, softcap, window) -> Tensor:
    """Per KV head the squared errors and norms of logits and outputs: [H_kv, 4] as
    (logit error, logit norm, output error, output norm), summed over attended entries.

    q [H_q, Q, D]; exact / served: (K, V) each [H_kv, C, D]; q_pos [Q], k_pos [C]."""
    (k, v), (k_hat, v_hat) = exact, served
    h_kv = k.shape[0]
    group = q.shape[0] // h_kv  # query head j reads KV head j // group
    chunk = max(1, CHUNK_LOGITS // (group * k.shape[1]))
    sums = torch.zeros(h_kv, 4, dtype=torch.float64)
    for h in range(h_kv):
        qh = q[h * group : (h + 1) * group]  # [G, Q, D]
        for start in range(0, q.shape[1], chunk):
            part = qh[:, start : start + chunk]
            mask = _mask(q_pos[start : start + chunk], k_pos, window)  # [q, C]
            s, o = _attend(part, k[h], v[h], mask, scale, softcap)
            s_hat, o_hat = _attend(part, k_hat[h], v_hat[h], mask, scale, softcap)
            sums[h] += torch.stack(
                [torch.where(mask, s_hat - s, 0.0).square().sum(),
                 torch.where(mask, s, 0.0).square().sum(),
                 (o_hat - o).square().sum(), o.square().sum()]
            ).double().cpu()  # fmt: skip
    return sums


def _rows_error(x: Tensor, x_hat: Tensor, rows: Tensor) -> float | None:
    """Relative MSE over the rows picked by `rows` ([C] bool); x, x_hat [H, C, D]."""
    if not bool(rows.any()):
        return None
    return _rel_mse(float((x_hat - x)[:, rows].square().sum()), float(x[:, rows].square().sum()))


def _reconstruction(k, k_hat, v, v_hat, u: Tensor, tokens: int, sink: int, recent: int) -> dict:
    """K/V relative MSE of the user's rows (u [C]: each row's index in the prompt) by
    position bucket, channel, and the sink / body / recent rows."""
    every = torch.ones_like(u, dtype=torch.bool)
    buckets = []
    for b in range(POSITION_BUCKETS):
        lo, hi = b * tokens // POSITION_BUCKETS, (b + 1) * tokens // POSITION_BUCKETS
        rows = (u >= lo) & (u < hi)
        buckets.append((lo, hi, int(rows.sum()), rows))
    # per channel: its squared error over heads and rows against the mean channel energy, so
    # that the channels' figures average to the layer's (a near-silent channel cannot blow up)
    err_c = (k_hat - k).square().sum((0, 1))  # [D]
    mean_c = float(k.square().sum()) / k.shape[-1]
    worst = torch.argsort(err_c, descending=True)[:WORST_CHANNELS].tolist()
    is_sink = u < sink
    is_recent = (u >= tokens - recent) & ~is_sink

    def group(rows: Tensor, **extra) -> dict:
        return {
            **extra,
            "rows": int(rows.sum()),
            "k_rel_mse": _rows_error(k, k_hat, rows),
            "v_rel_mse": _rows_error(v, v_hat, rows),
        }

    return {
        "k_rel_mse": _rows_error(k, k_hat, every),
        "v_rel_mse": _rows_error(v, v_hat, every),
        "k_by_position": [
            {"start": lo, "stop": hi, "rows": n, "rel_mse": _rows_error(k, k_hat, r)}
            for lo, hi, n, r in buckets
        ],
        "v_by_position": [
            {"start": lo, "stop": hi, "rows": n, "rel_mse": _rows_error(v, v_hat, r)}
            for lo, hi, n, r in buckets
        ],
        "k_worst_channels": [[c, _rel_mse(float(err_c[c]), mean_c)] for c in worst],
        "sink": group(is_sink, tokens=sink),
        "recent": group(is_recent, tokens=recent),
        "body": group(~is_sink & ~is_recent),
    }


def _head_errors(sums: Tensor, k, k_hat, v, v_hat) -> list[dict]:
    """Per KV head: attention errors from `sums` [H_kv, 4], K/V relative MSE of the rows
    k, v [H_kv, C, D]."""
    every = torch.ones(k.shape[1], dtype=torch.bool, device=k.device)
    return [
        {
            "head": h,
            "logit_rel_error": _ratio(sums[h, 0].item(), sums[h, 1].item()),
            "output_rel_error": _ratio(sums[h, 2].item(), sums[h, 3].item()),
            "k_rel_mse": _rows_error(k[h : h + 1], k_hat[h : h + 1], every),
            "v_rel_mse": _rows_error(v[h : h + 1], v_hat[h : h + 1], every),
        }
        for h in range(sums.shape[0])
    ]


@torch.no_grad()
def _layer(adapter, i: int, cache_layer, kv, q: Tensor, prefix_len: int, tokens: int) -> dict:
    """The report of layer `i`: kv the exact (K, V) [1, H_kv, L, D], q its queries
    [H_q, T, D], both sides over the rows `cache_layer` holds."""
    k_hat, v_hat, k_pos = _held(cache_layer, prefix_len)  # [H_kv, C, D], [C]
    device = k_hat.device
    k, v = (x[0].to(device).float()[:, k_pos] for x in kv)  # the same rows, exact
    user = k_pos >= prefix_len  # the prompt's rows (prefix rows are exact by declaration)
    # the queries whose own row is still held (a sliding layer keeps only its last window)
    q_pos = prefix_len + torch.arange(tokens, device=device)
    keep = q_pos >= int(k_pos[user].min())
    softcap = getattr(adapter.attention(i), "attn_logit_softcapping", None)
    sums = _attention_sums(
        q.to(device)[:, keep], (k, v), (k_hat, v_hat), q_pos[keep], k_pos,
        adapter.attention_scaling(i), softcap, adapter.sliding_window(i),
    )  # fmt: skip
    total = sums.sum(0)
    k, k_hat, v, v_hat = (x[:, user] for x in (k, k_hat, v, v_hat))
    policy = cache_layer.policy
    sink = policy.sink_tokens or 1  # none kept exact: the first token, the usual sink
    recent = policy.residual_tokens or RECENT_ROWS
    rec = _reconstruction(k, k_hat, v, v_hat, k_pos[user] - prefix_len, tokens, sink, recent)
    return {
        "layer": i,
        "sliding_window": adapter.sliding_window(i),
        "rows": int(user.sum()),
        "queries": int(keep.sum()),
        "logit_rel_error": _ratio(total[0].item(), total[1].item()),
        "output_rel_error": _ratio(total[2].item(), total[3].item()),
        "k_rel_mse": rec.pop("k_rel_mse"),
        "v_rel_mse": rec.pop("v_rel_mse"),
        "heads": _head_errors(sums, k, k_hat, v, v_hat),
        **rec,
    }


def _cache_info(ctx: TaskContext, cache) -> dict:
    policy = cache.policy
    schemes = sorted({f"K {lp.key.describe()}, V {lp.value.describe()}" for lp in policy.layers})
    return {
        "name": ctx.cache_name,
        "policy": policy.name,
        "schemes": schemes,
        "key_stage": sorted({lp.key_stage for lp in policy.layers}),
        "sink_tokens": sorted({lp.sink_tokens for lp in policy.layers}),
        "residual_tokens": sorted({lp.residual_tokens for lp in policy.layers}),
        "prefix_tokens": 0 if policy.prefix is None else len(policy.prefix.token_ids),
        "backend": ctx.backend,
    }


# --- the task ---------------------------------------------------------------------------


def run(ctx: TaskContext) -> dict:
    cache = ctx.make_cache()
    spec = cache.policy.prefix  # declared prefix rows are served before the prompt
    prefix_ids = () if spec is None else tuple(spec.token_ids)
    ids = _prompt(ctx, spec)  # [1, T]
    tokens = ids.shape[1]
    served = torch.cat([torch.tensor([prefix_ids], dtype=torch.long), ids], 1)
    with ctx.progress.stage("attention: unquantized forward"):
        kv, queries = _reference(ctx.loaded, served, tokens)
    with ctx.progress.stage("attention: quantized cache"):
        _serve(cache, kv, len(prefix_ids))
    layers, adapter = [], ctx.loaded.adapter
    with ctx.progress.stage("attention: errors", total=len(kv)) as stage:
        for i, (layer, rows, q) in enumerate(zip(cache.layers, kv, queries, strict=True)):
            layers.append(_layer(adapter, i, layer, rows, q, len(prefix_ids), tokens))
            stage.advance()
    logit = [x["logit_rel_error"] for x in layers]
    output = [x["output_rel_error"] for x in layers]
    worst = max(range(len(layers)), key=lambda i: output[i] or 0.0)
    return {
        "params": ctx.params.as_dict(),
        "cache": _cache_info(ctx, cache),
        "tokens": tokens,
        "layers": layers,
        "mean_logit_rel_error": sum(x or 0.0 for x in logit) / len(layers),
        "mean_output_rel_error": sum(x or 0.0 for x in output) / len(layers),
        "worst_layer": worst,
    }


def summary(section: dict) -> list[tuple[str, str, str]]:
    worst = section["layers"][section["worst_layer"]]
    return [
        ("attention logit rel. error (mean over layers)", "0",
         f"{section['mean_logit_rel_error']:.3g}"),
        ("attention output rel. error (mean)", "0", f"{section['mean_output_rel_error']:.3g}"),
        ("worst layer", "", f"{worst['layer']} (output {worst['output_rel_error'] or 0:.3g})"),
    ]  # fmt: skip


def plot(section: dict, folder: Path) -> list[Path]:
    """Per-layer logit and output relative error, side by side: {folder}/attention_error.png."""
    # a Figure on the Agg canvas: no pyplot, so no global backend switch and no GUI
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers = [x["layer"] for x in section["layers"]]
    width = 0.4
    fig = Figure(figsize=(max(6, 0.4 * len(layers)), 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for shift, key, label in ((-width / 2, "logit_rel_error", "logits"),
                              (width / 2, "output_rel_error", "output")):  # fmt: skip
        values = [x[key] or 0.0 for x in section["layers"]]
        ax.bar([i + shift for i in layers], values, width, label=label)
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error ||Δ|| / ||exact||")
    ax.set_title(f"attention error: {section['cache']['name']}, {section['tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    path = Path(folder) / "attention_error.png"
    fig.savefig(path, dpi=100)
    return [path]


TASK = EvalTask(name="attention", run=run, summary=summary, plot=plot)
