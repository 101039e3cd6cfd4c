"""A released checkpoint's own target, run by transformers, behind the loop's target interface
(``speculative.TargetModel``: prefill, verify, rollback, the post-final-norm hidden rows).

The target is transformers' model for the ``config.json``'s ``model_type``
(``Glm5NextForConditionalGeneration`` for ``glm5_next``: KDA linear layers and DSA layers inside
mHC hyper-connections; ``GlmMoeDsaForCausalLM`` for ``glm_moe_dsa``); it ignores the MTP layer,
which the package drafts with (``MtpWeights.from_pretrained`` of the same directory). The hidden
the drafter reads is the language model's ``last_hidden_state``: the final norm's output
(glm5_next: ``norm(hc_head(streams))``; its ``output_hidden_states`` are 4-D stream tensors).

Rollback is exact or refused. A KDA layer keeps a recurrent state and a short-convolution window,
not rows, so its cache can only go back to states it recorded: each state's ``DynamicCache``
records the last ``max_verify`` states of every forward (``activate_past_recording``), and
``crop`` restores one. If a forward was longer than the recorded window, ``crop`` would silently
restore the wrong state, so the adapter keeps the rules that make it exact:

- a verify feeds at most ``max_verify`` tokens (the loop's k + 1);
- a rollback reaches only into the last verify (it cannot undo a prefill or an earlier verify);
- the next verify first settles the previous one (``crop(0)``: its tokens are kept).

Anything else raises ``ValueError`` naming the rule, before the cache is touched.

The DSA indexer picks its rows with ``topk``, whose ties torch breaks as its kernels happen to
(the scores tie exactly at 0 when every indexer head's relu is 0), differently at different
query counts: a verify of k + 1 tokens and k + 1 one-token decodes could then attend different
rows. ``topk_ties='lower_index'`` (the default) sends ties to the lower index, as the drafter
does (DESIGN.md §6), by a stable sort swapped in for ``torch.topk`` during the target's forward
(the MoE router's top-k takes it too: ties there do not occur with real scores);
``topk_ties='torch'`` leaves torch's.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

from glm_mtp.reference.numerics import acc_dtype

from .target import TargetOutput

EXTRA = "pip install 'glm-mtp[hf]'"
HF_DEVICES = ("cpu", "cuda", "auto")
TOPK_TIES = ("lower_index", "torch")


def require_transformers(what: str = "model=hf") -> Any:
    """transformers, imported; ``ImportError`` in one line naming the extra when it is missing."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{what} runs the target with transformers, which is not installed: {EXTRA}") from None
    return transformers


def target_class(model_type: object) -> type:
    """transformers' model class for a checkpoint's ``model_type``."""
    require_transformers()
    if model_type == "glm5_next":
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

        return Glm5NextForConditionalGeneration
    if model_type == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaForCausalLM

        return GlmMoeDsaForCausalLM
    raise ValueError(f"model.path: model_type must be glm5_next or glm_moe_dsa for model=hf, got {model_type!r}")


def topk_lower_index(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    """``torch.topk`` with ties to the lower index: a stable sort, cut to ``k``."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def pinned_topk(ties: str) -> Iterator[None]:
    """Within the block, ``torch.topk`` and ``Tensor.topk`` break ties to the lower index
    (``ties='lower_index'``); ``ties='torch'`` changes nothing."""
    if ties == "torch":
        yield
        return
    saved = torch.topk, torch.Tensor.topk
    torch.topk = topk_lower_index
    torch.Tensor.topk = topk_lower_index
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = saved


@dataclass
class HfState:
    """One sequence: transformers' cache, the positions it holds, and how many of them the last
    verify wrote while a rollback can still undo them (0 once settled)."""

    cache: Any
    length: int = 0
    pending: int = 0


class HfTarget:
    """transformers' model as the loop's target.

    Args:
        model: a ``Glm5NextForConditionalGeneration`` or ``GlmMoeDsaForCausalLM`` (``load_hf_model``).
        max_verify: the longest verify (k + 1): the window every state records for its rollback.
        max_seq_len: the longest sequence a state serves.
        hidden_device: where the hidden rows go (the drafter's device).
        topk_ties: ``lower_index`` (ties of the indexer's top-k to the lower index) or ``torch``.
    """

    def __init__(self, model: Any, max_verify: int, max_seq_len: int, hidden_device: torch.device | str = "cpu",
                 topk_ties: str = "lower_index") -> None:
        if isinstance(max_verify, bool) or not isinstance(max_verify, int) or max_verify < 1:
            raise ValueError(f"max_verify must be an integer >= 1, got {max_verify!r}")
        if topk_ties not in TOPK_TIES:
            raise ValueError(f"topk_ties must be one of {TOPK_TIES}, got {topk_ties!r}")
        self.model, self.max_verify, self.max_seq_len = model, max_verify, max_seq_len
        self.hidden_device, self.topk_ties = torch.device(hidden_device), topk_ties
        self.body = model.model  # the decoder stack: last_hidden_state is the final norm's output
        self.input_device = model.get_input_embeddings().weight.device

    def alloc_state(self) -> HfState:
        """An empty cache that records the last ``max_verify`` states of each forward."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording(recurrent_states_to_keep=self.max_verify)
        return HfState(cache)

    def _forward(self, tokens: list[int], state: HfState) -> TargetOutput:
        if state.length + len(tokens) > self.max_seq_len:
            raise ValueError(f"tokens: positions up to {state.length + len(tokens)} run past the target's max_seq_len "
                             f"of {self.max_seq_len}")
        ids = torch.tensor([list(tokens)], device=self.input_device)
        with torch.no_grad(), pinned_topk(self.topk_ties):
            hidden = self.body(input_ids=ids, cache=state.cache, use_cache=True).last_hidden_state[0]  # (T, H)
            logits = self.model.lm_head(hidden).to(acc_dtype(hidden.dtype))
        state.length += len(tokens)
        return TargetOutput(logits=logits, hidden=hidden.to(self.hidden_device))

    def prefill(self, tokens: list[int], state: HfState) -> TargetOutput:
        """The prompt at positions ``[0, n)``; it is never rolled back (its record is dropped)."""
        if state.length:
            raise ValueError(f"prefill needs an empty state; this one holds {state.length} positions (alloc_state a "
                             "new one)")
        if len(tokens) < 1:
            raise ValueError("tokens: a prefill needs at least one token")
        out = self._forward(tokens, state)
        state.cache.crop(0)  # keeps what the next forward needs, drops the record
        return out

    def verify(self, tokens: list[int], state: HfState) -> TargetOutput:
        """``tokens`` (at most ``max_verify``) at positions ``[length, length + T)``; the previous
        verify, if not rolled back, is settled first (its tokens kept)."""
        if not 1 <= len(tokens) <= self.max_verify:
            raise ValueError(f"tokens: a verify feeds 1 to max_verify={self.max_verify} tokens (the recorded window, "
                             f"so its rollback is exact), got {len(tokens)}")
        if not state.length:
            raise ValueError("verify needs a prefilled state (prefill the prompt first)")
        if state.pending:
            state.cache.crop(0)
            state.pending = 0
        out = self._forward(tokens, state)
        state.pending = len(tokens)
        return out

    def rollback(self, state: HfState, length: int) -> None:
        """Keep positions ``< length``: only positions the last verify wrote can go (a recorded
        state is restored exactly); ``length`` equal to the held length settles that verify."""
        start = state.length - state.pending
        if not start <= length <= state.length:
            raise ValueError(f"length: a rollback reaches only into the last verify (positions [{start}, "
                             f"{state.length}], the states recorded for an exact rollback), got {length}")
        state.cache.crop(length - state.length)  # a negative count: that many positions removed; 0 settles
        state.length, state.pending = length, 0


# ------------------------------------------------------------------------------------------------
# Loading


@dataclass
class HfCheckpoint:
    """transformers' target of a checkpoint directory, with what a run records of it."""

    model: Any
    tokenizer: Any
    info: dict[str, Any] = field(default_factory=dict)


class HfTokenizer:
    """A checkpoint's own tokenizer: ``encode`` (text without added special tokens, for windows
    of plain text), ``encode_prompt`` (a prompt as the model is served it), ``encode_chat``
    (messages through its chat template, with the generation prompt), ``decode``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: the checkpoint's tokenizer has no chat template (give `prompt` text instead)")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, n)) for n in ("tokenizer.json", "tokenizer_config.json",
                                                                    "tokenizer.model"))


def load_hf_model(directory: str, device: str, dtype: torch.dtype, tokenizer: bool = True) -> HfCheckpoint:
    """transformers' target of ``directory`` in ``dtype`` on ``device`` (``cpu``, ``cuda``, or
    ``auto``: accelerate's device map over the visible GPUs), from local files only, and, with
    ``tokenizer``, transformers' tokenizer when the directory has one."""
    from .provenance import file_sha256

    transformers = require_transformers()
    if device not in HF_DEVICES:
        raise ValueError(f"model.device must be one of {', '.join(HF_DEVICES)}; got {device!r}")
    if device == "auto":
        try:
            import accelerate  # noqa: F401  (device_map='auto' places the layers with it)
        except ImportError:
            raise ImportError("model.device=auto places the layers with accelerate, which is not installed: "
                              f"{EXTRA}") from None
    config_file = os.path.join(directory, "config.json")
    with open(config_file) as f:
        model_type = json.load(f).get("model_type")
    cls = target_class(model_type)
    # Quiet while loading: the MTP layer is reported as unexpected keys, tensor by tensor, and a
    # progress bar per load would stand among the run's lines.
    verbosity, bar = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(directory, dtype=dtype, device_map=None if device == "cpu" else device,
                                    local_files_only=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bar:
            transformers.utils.logging.enable_progress_bar()
    model.eval()
    hf_tokenizer = None
    if tokenizer and has_tokenizer(directory):
        from transformers import AutoTokenizer

        hf_tokenizer = HfTokenizer(AutoTokenizer.from_pretrained(directory, local_files_only=True))
    device_map = getattr(model, "hf_device_map", None) or {"": str(model.get_input_embeddings().weight.device)}
    info = {"implementation": "transformers", "transformers_version": transformers.__version__, "class": cls.__name__,
            "model_type": model_type, "config_sha256": file_sha256(config_file), "device": device,
            "device_map": {k: str(v) for k, v in device_map.items()}, "dtype": str(dtype).removeprefix("torch.")}
    return HfCheckpoint(model, hf_tokenizer, info)


def drafter_device(checkpoint: HfCheckpoint) -> torch.device:
    """Where the drafter runs: beside the target's head (its last layers' device)."""
    return checkpoint.model.lm_head.weight.device
