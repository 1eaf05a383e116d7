"""lm-evaluation-harness through the kvq cache: the `kvq` model type.

    pip install 'kvq-live[eval]'
    python -m kvq.integrations.lm_eval --model kvq \\
        --model_args pretrained=gemma3-270m,artifact=artifacts/int4 --tasks hellaswag

`python -m kvq.integrations.lm_eval` takes exactly the arguments of the `lm_eval` command (it
is that command, with `kvq` registered). The plain `lm_eval` script cannot find `kvq`:
lm-eval (0.4.x, checked on 0.4.13) knows only the model types in its own registry, which
`register_model` fills when a module is imported, and it reads no entry points and imports
no plugins (`--include_path` adds tasks only). From Python, import this module first:

    import lm_eval, kvq.integrations.lm_eval
    lm_eval.simple_evaluate(model="kvq", model_args="pretrained=DIR,policy=int8", tasks=[...])

model_args:
  pretrained  anything `kvq.load_model` accepts: "gemma3-270m" (the default), a local Hugging
              Face folder, a .gguf file
  artifact    an artifact folder: checked against the model's identity, its model transforms
              folded into the weights (once)
  policy      or a calibration-free policy name: int8, int4, int2, fp16, kivi2, ...
  (neither)   the unquantized baseline, through transformers' DynamicCache, for comparison
plus HFLM's options that apply to a loaded model (`_HFLM_ARGS`): batch_size, device,
max_length, ... KVQ_BACKEND picks the attention backend as everywhere in kvq.

Every forward lm-eval runs (loglikelihood, rolling perplexity, generation) gets a fresh
cache, so attention reads the rows the cache stored: for a policy or an artifact, the
quantized ones. batch_size 1 (the default) scores each request alone. lm-eval right-pads
larger loglikelihood batches without an attention mask: per-token schemes do not mind, but
a sequence's padding can share a KIVI-style per-channel key group (or the exact residual
window) with its last tokens.
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers import DynamicCache

import kvq
from kvq.errors import KvqError

# HFLM's options that still mean something once kvq has loaded the model; the others (revision,
# dtype, peft, parallelize, ...) are about loading through transformers and would be ignored
# silently by HFLM for a model object, so they are refused instead.
_HFLM_ARGS = frozenset(
    {
        "batch_size", "max_batch_size", "max_length", "truncation", "logits_cache",
        "add_bos_token", "prefix_token_id", "softmax_dtype", "mixed_precision_dtype",
        "think_end_token", "enable_thinking", "chat_template_args",
    }
)  # fmt: skip
_OWN_ARGS = ("pretrained", "artifact", "policy", "device")


def _device(requested: str | None) -> torch.device:
    # lm_eval's CLI asks for cuda:0 by default; fall back to the CPU like HFLM does
    cuda = torch.cuda.is_available()
    if requested is None or (str(requested).startswith("cuda") and not cuda):
        return torch.device("cuda" if cuda else "cpu")
    return torch.device(requested)


@register_model("kvq")
class KvqLM(HFLM):
    """HFLM over a model loaded by kvq, every forward and generate on a fresh kvq cache."""

    def __init__(
        self,
        pretrained: str = "gemma3-270m",
        artifact: str | None = None,
        policy: str | None = None,
        device: str | None = None,
        **kwargs,
    ) -> None:
        unknown = sorted(set(kwargs) - _HFLM_ARGS)
        if unknown:
            known = ", ".join([*_OWN_ARGS, *sorted(_HFLM_ARGS)])
            raise KvqError(f"--model kvq: unknown model_args {', '.join(unknown)}; known: {known}")
        if artifact is not None and policy is not None:
            raise KvqError("--model kvq: give artifact or policy in model_args, not both")
        model, tokenizer = kvq.load_model(str(pretrained))
        model.to(_device(device))  # before folding any transform: HFLM keeps a model's device
        # read and identity-checked once; each cache is then built from the loaded artifact
        self._artifact = kvq.load_artifact(str(artifact), model) if artifact is not None else None
        self._policy = policy
        self._kvq_args = {"kvq_model": str(pretrained), "kvq_artifact": artifact,
                          "kvq_policy": policy}  # fmt: skip
        super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
        self._new_cache()  # an unknown policy fails now, and the artifact's transforms fold

    def _new_cache(self):
        if self._artifact is None and self._policy is None:
            return DynamicCache(config=self.model.config)
        return kvq.make_cache(self.model, artifact=self._artifact, policy=self._policy)

    def _model_call(self, inps, attn_mask=None, labels=None):
        # attn_mask and labels are HFLM's encoder-decoder call; kvq models are decoder-only.
        # use_cache with a fresh cache: the rows are stored (quantized) first, then attention
        # reads them back, as it does when serving
        autocast = torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        )
        with torch.no_grad(), autocast:
            return self.model(inps, cache=self._new_cache(), use_cache=True).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        return super()._model_generate(
            context, max_length, stop, cache=self._new_cache(), **generation_kwargs
        )

    def get_model_info(self) -> dict:
        # HFLM's asks the hub for the model's commit: kvq runs offline and its specs are no
        # hub ids. What the results need to say instead is which cache scored them.
        return {
            "model_num_parameters": self.model.num_parameters(),
            "model_dtype": str(self.model.dtype),
            **self._kvq_args,
        }


def main() -> None:
    """The `lm_eval` command, with `kvq` registered; a KvqError is one line and exit code 2."""
    from lm_eval.__main__ import cli_evaluate

    from kvq.cli.common import fail

    try:
        cli_evaluate()
    except KvqError as e:
        fail(str(e))


if __name__ == "__main__":  # python -m kvq.integrations.lm_eval ARGS (the lm_eval CLI's ARGS)
    main()
