"""Checks of the entry points' settings, run before any work: a bad value is one clear line and
exit status 2, never a traceback from deep inside the run nor a failure after minutes of work.

- ``check_acceptance(cfg)`` / ``check_train(cfg)``: the Hydra configs (conf/config.yaml,
  conf/train.yaml) of ``acceptance`` and ``train``; each names the key and the rule;
- ``exit_on_bad_config(check, cfg, run_dir)``: the hook at the top of a Hydra main: on a bad
  value it prints one line, removes what Hydra already wrote into ``run_dir`` (so no empty run
  directory is left behind) and exits 2;
- ``unwritable_dir(path)``: why an output folder could not be written, checked before a run.

Plain Python: importing this module imports neither Hydra nor W&B.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from typing import Any, Callable

from glm_mtp.ranges import SEED_MAX, THREADS_MAX, check_int_range
from glm_mtp.registry import BACKENDS, backend_class

from ..loop.stop_rules import check_stop_rule
from .prompts import MIN_PROMPT_TOKENS
from .sampling import check_sampling
from .prompts import SOURCES as PROMPT_SOURCES
from ..loop.round import DRAFTS, POLICIES
from ..targets.target import TARGET_NUMERICS

FEED_HIDDEN = ("post_norm", "pre_norm")
MODEL_KINDS = ("checkpoint", "random", "hf")
MODEL_DTYPES = ("float32", "float64", "bfloat16")  # names of glm_mtp.registry.DTYPES (a test keeps them so)
LOGGERS = ("none", "wandb")
# An acceptance run's modes and text sources.
MODES = ("speculative", "teacher_forced")
SOURCES = PROMPT_SOURCES


def _get(cfg: Any, key: str) -> Any:
    """``cfg``'s value at a dotted ``key``; ``ValueError`` naming it when it is missing."""
    node = cfg
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f"{key} is missing") from None
        except Exception as e:  # omegaconf: a mandatory value left as ??? or a bad interpolation
            raise ValueError(f"{key}: {e}") from None
    return node


def need_int(cfg: Any, key: str, minimum: int, maximum: int | None = None) -> int:
    """An integer in ``[minimum, maximum]`` (``glm_mtp.ranges``: the range its consumer accepts)."""
    return check_int_range(key, _get(cfg, key), minimum, maximum)


def need_seed(cfg: Any, key: str) -> int:
    return need_int(cfg, key, 0, SEED_MAX)


def need_threads(cfg: Any, key: str) -> int:
    return need_int(cfg, key, 1, THREADS_MAX)


def need_float(cfg: Any, key: str, minimum: float, strict: bool = False) -> float:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    v = _get(cfg, key)
    bound = f"> {minimum}" if strict else f">= {minimum}"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number {bound}, got {v!r}")
    if v < minimum or (strict and v == minimum):
        raise ValueError(f"{key} must be {bound}, got {v!r}")
    return float(v)


def need_choice(cfg: Any, key: str, choices: tuple[str, ...]) -> str:
    v = _get(cfg, key)
    if v not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}; got {v!r}")
    return v


def need_bool(cfg: Any, key: str) -> bool:
    v = _get(cfg, key)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


def check_logger(cfg: Any) -> None:
    need_choice(cfg, "logger.name", LOGGERS)
    if _get(cfg, "logger.name") == "wandb":
        need_choice(cfg, "logger.mode", ("offline", "online", "disabled"))


ATTENTION = ("sparse", "dense")


def check_attention(attention: object, backend: str, model: Any) -> str:
    """``attention``: ``sparse`` (the drafter's own selection) or ``dense`` (every visible row: the
    KPool selection swapped in the reference drafter, so a glm5_next model on backend=reference).
    ``ValueError`` naming the setting otherwise."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}; got {attention!r}")
    if attention == "dense":
        if backend != "reference":
            raise ValueError("attention=dense swaps the drafter's KPool selection in the reference drafter only "
                             f"(backend=reference); backend={backend} fuses its own selection")
        if not model.is_next:
            raise ValueError("attention=dense swaps the KPool indexer of a glm5_next model (e.g. model=next_shipped); "
                             "this model is of the glm5 family")
    return attention


def check_batch_size(batch_size: object, mode: str, policy: str, draft: str) -> int:
    """``batch_size``: an integer >= 1; above 1 the loop runs batched (``generate_batch``), which
    needs the speculative mode, ``policy=first_row_kept`` and ``draft=argmax``. ``ValueError``
    naming the option otherwise."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if batch_size > 1:
        if mode != "speculative":
            raise ValueError(f"batch_size > 1 batches the speculative loop; mode={mode} runs one text at a time "
                             "(batch_size=1)")
        if policy != "first_row_kept":
            raise ValueError(f"batch_size > 1 runs policy=first_row_kept only; policy={policy} is single-sequence "
                             "(batch_size=1)")
        if draft != "argmax":
            raise ValueError(f"batch_size > 1 runs draft=argmax only; draft={draft} is single-sequence (batch_size=1)")
    return batch_size


WEIGHT_FORMATS = ("plain", "fp8")


def weights_dtype(mcfg: Any) -> str:
    """``model.weights_dtype``: ``plain`` (the default, also for configs without the key) or ``fp8``."""
    v = mcfg.get("weights_dtype", "plain") or "plain"
    if v not in WEIGHT_FORMATS:
        raise ValueError(f"model.weights_dtype must be one of {', '.join(WEIGHT_FORMATS)}; got {v!r}")
    return v


def check_drafter_weights(backend: str, dtype: str, weights_format: str) -> None:
    """Both backends draft with fp8 weights (``model.weights_dtype=fp8``); the optimized one reads
    them in its fused step's kernels only, whose storage dtypes are ``KERNEL_DTYPES`` (its
    constructor refuses others): checked here, before any model is built."""
    if weights_format != "fp8" or backend != "optimized":
        return
    from glm_mtp.optimized.kernels import KERNEL_DTYPES
    from glm_mtp.registry import DTYPES

    if DTYPES[dtype] not in KERNEL_DTYPES:
        names = " or ".join(str(d).removeprefix("torch.") for d in KERNEL_DTYPES)
        raise ValueError(f"model.weights_dtype=fp8 with backend=optimized needs model.dtype {names} (the fused step's "
                         f"kernels read block-scaled weights; a {dtype} drafter runs the per-primitive path, which "
                         f"reads none), got {dtype}")


def index_share(mcfg: Any) -> bool | None:
    """``model.index_share``: ``null`` (the default, also for configs without the key) drafts with
    the checkpoint's ``index_share_for_mtp_iteration``; ``true``/``false`` override it (DESIGN.md
    §9; ``MtpWeights.with_index_share``)."""
    v = mcfg.get("index_share", None)
    if v is not None and not isinstance(v, bool):
        raise ValueError("model.index_share must be true, false or null (the checkpoint's "
                         f"index_share_for_mtp_iteration); got {v!r}")
    return v


def check_acceptance(cfg: Any, model: Any = None) -> None:
    """The acceptance experiment's settings (conf/config.yaml and its groups). ``model``: the
    ``MtpConfig`` of a checkpoint that does not exist yet (a grid job's, trained first), checked
    against instead of reading ``model.path``. A replay (``trace.path``) first takes the settings
    its trace fixes (``traces.replay_keys``: set in ``cfg``, a conflicting one refused) and reads
    no prompts file."""
    replay = (cfg.get("trace") or {}).get("path") is not None
    if replay:
        from ..traces.replay_keys import take_replay_settings

        take_replay_settings(cfg)
    need_choice(cfg, "mode", MODES)
    need_choice(cfg, "source", SOURCES)
    need_int(cfg, "num_drafts", 1)
    need_choice(cfg, "policy", POLICIES)
    temperature = need_float(cfg, "temperature", 0.0)
    check_sampling(cfg)  # top_p, top_k, verify (settings/sampling.py)
    if need_choice(cfg, "draft", DRAFTS) == "sampled" and not temperature > 0:
        raise ValueError("draft must be argmax at temperature 0 (sampled drafts are drawn from the drafter's softmax "
                         "at the temperature: draft=sampled needs temperature > 0)")
    numerics = need_choice(cfg, "target_numerics", tuple(TARGET_NUMERICS))
    need_choice(cfg, "feed_hidden", FEED_HIDDEN)
    need_seed(cfg, "seed")
    need_threads(cfg, "threads")
    check_batch_size(_get(cfg, "batch_size"), _get(cfg, "mode"), _get(cfg, "policy"), _get(cfg, "draft"))
    need_choice(cfg, "backend.name", tuple(sorted(BACKENDS)))
    kind = need_choice(cfg, "model.kind", MODEL_KINDS)
    need_choice(cfg, "model.dtype", MODEL_DTYPES)
    check_drafter_weights(_get(cfg, "backend.name"), _get(cfg, "model.dtype"), weights_dtype(_get(cfg, "model")))
    index_share(_get(cfg, "model"))
    need_int(cfg, "model.max_seq_len", 2)
    if kind == "random":
        need_seed(cfg, "model.seed")
    if kind == "hf":
        check_hf_model(cfg, numerics)
    if not replay:  # a replay's prompts are its trace's items
        check_prompts(cfg)
    need_int(cfg, "run.num_prompts", 1)
    need_int(cfg, "run.prompt_tokens", MIN_PROMPT_TOKENS)
    need_int(cfg, "run.max_new_tokens", 1)
    need_bool(cfg, "run.check_lossless")
    check_stop(cfg)
    costs = _get(cfg, "speedup.costs")
    from ..loop.speedup import costs_kind

    costs_kind(costs)  # measured, bytes:glm5, bytes:glm5next, a shipped table or a file, else the rule
    need_int(cfg, "speedup.repeats", 1)
    check_logger(cfg)
    # Settings whose rule needs another setting or a file: every file the run reads later is read now.
    from ..loop.speedup import check_costs_spec

    try:
        check_costs_spec(costs, _get(cfg, "num_drafts"))  # a file: read and checked field by field now
    except ValueError as e:
        raise ValueError(f"speedup.costs: {e}") from None
    model = model_config(cfg) if model is None else model
    check_attention(cfg.get("attention", "sparse"), _get(cfg, "backend.name"), model)
    check_lengths(cfg, model.max_position_embeddings)
    if not replay:
        check_user_prompts(cfg, min(_get(cfg, "model.max_seq_len"), model.max_position_embeddings))
    if draft_kind(cfg) == "sampled":
        check_sampling_temperature(cfg)
    check_grammar(cfg)
    if (cfg.get("trace") or {}).get("path") is not None:  # a replay: the whole trace checked, and against the drafter
        from ..traces.replay_run import open_for_replay

        open_for_replay(cfg, model)


# The recording's keys (python -m glm_mtp.experiments.record): a live acceptance run records
# nothing, so given, each is refused (a replay refuses them too: traces.replay_keys.NOT_READ).
RECORDING_KEYS = ("trace.out", "trace.max_drafts", "trace.batch_size", "trace.cost_repeats")


def check_acceptance_run(cfg: Any, model: Any = None) -> None:
    """An acceptance run's settings (``check_acceptance``, which a recording shares), and none of
    the recording's keys (``RECORDING_KEYS``) given to a live run, which would drop them.
    ``ValueError`` naming the key."""
    check_acceptance(cfg, model)
    if (cfg.get("trace") or {}).get("path") is not None:
        return  # a replay refused them already (traces.replay_keys)
    from .explicit import given_keys, plain, value_at

    for key in given_keys(cfg, RECORDING_KEYS):
        raise ValueError(f"{key}={plain(value_at(cfg, key))!r} is a recording's setting and this run records nothing "
                         "(record a trace with python -m glm_mtp.experiments.record ... trace.out=DIR): leave it unset")


def check_stop(cfg: Any) -> None:
    """``stop.rule`` and ``stop.threshold`` (``loop/stop_rules.py``): a known rule, and a finite
    number for a rule that trims (null for none). A config without a ``stop`` node verifies every
    draft."""
    node = cfg.get("stop")
    if node is None:
        return
    check_stop_rule(node.get("rule", "none"), node.get("threshold"))


def check_hf_model(cfg: Any, numerics: str) -> None:
    """model=hf: transformers installed (one line naming the extra otherwise), ``model.device``
    and ``model.topk_ties`` known, and the package's own target settings left alone."""
    from ..targets.hf_target import HF_DEVICES, TOPK_TIES, require_transformers

    try:
        require_transformers()
    except ImportError as e:
        raise ValueError(str(e)) from None
    device = need_choice(cfg, "model.device", HF_DEVICES)
    if device == "auto":
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise ValueError("model.device=auto places the layers with accelerate, which is not installed: "
                             "pip install 'glm-mtp[hf]'") from None
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("model.device=cuda runs the target on a GPU, but CUDA is not available here (use "
                             "model.device=cpu)")
    need_choice(cfg, "model.topk_ties", TOPK_TIES)
    if device == "cpu" and _get(cfg, "backend.name") == "optimized":
        raise ValueError("backend=optimized drafts on CUDA, and model=hf puts the drafter beside the target's head: "
                         "model.device=cpu leaves it on the CPU (use model.device=cuda or auto, or backend=reference)")
    if numerics != "vendor":
        raise ValueError(f"target_numerics={numerics} sets the package's own target; model=hf verifies with "
                         "transformers' (leave target_numerics=vendor)")
    if _get(cfg, "model").get("path") is None:
        raise ValueError("model.path must be a checkpoint directory for model=hf (config.json, safetensors, as "
                         "released)")


def check_prompts(cfg: Any) -> None:
    """source=jsonl / text read ``prompts.path`` (a JSONL file; a text file or a folder); jsonl
    holds prompts only, so it runs the speculative mode. Another source reads no file, so a
    ``prompts.path`` beside it is refused (it would be ignored)."""
    source = _get(cfg, "source")
    node = cfg.get("prompts") or {}
    path = node.get("path")
    if source not in ("jsonl", "text"):
        if path is not None:
            raise ValueError(f"prompts.path is read by source=jsonl or source=text; source={source} reads no file and "
                             f"would ignore {path!r} (set source, or leave prompts.path null)")
        return
    if not isinstance(path, str):
        raise ValueError(f"source={source} reads prompts.path, which must be a file path; got {path!r}")
    if source == "jsonl":
        if not os.path.isfile(path):
            raise ValueError(f"prompts.path must be a JSONL file (one prompt a line) for source=jsonl; {path!r} is not "
                             "a file")
        if _get(cfg, "mode") != "speculative":
            raise ValueError("source=jsonl holds prompts, not text to score: it runs mode=speculative (use source=text "
                             "for mode=teacher_forced)")
    elif not os.path.exists(path):
        raise ValueError(f"prompts.path must be a text file or a folder of them for source=text; {path!r} does not "
                         "exist")


def check_user_prompts(cfg: Any, longest: int) -> None:
    """The user's prompts file (source=jsonl / text), read whole before any model loads, as the
    run reads it (``prompts.user_prompts``): every line parsed, decoded and tokenized with the
    checkpoint's tokenizer, each prompt at least ``MIN_PROMPT_TOKENS`` and, with its
    continuation and one verify, within ``longest`` rows; a text long enough for its windows."""
    from ..targets.checkpoint import SHIPPED, checkpoint_tokenizer, shipped_checkpoint
    from .prompts import check_prompt_lengths, user_prompts

    source = _get(cfg, "source")
    if source not in ("jsonl", "text"):
        return
    kind, path = _get(cfg, "model.kind"), _get(cfg, "model").get("path")
    if kind == "checkpoint" and path is None:
        path = str(shipped_checkpoint(_get(cfg, "model").get("shipped") or SHIPPED))
    tokenizer = None if kind == "random" else checkpoint_tokenizer(kind, path)
    if tokenizer is None:
        raise ValueError(f"source={source} tokenizes prompts.path with the checkpoint's tokenizer; this model has none "
                         f"(model.kind={kind}{'' if kind == 'random' else ', no tokenizer files in model.path'})")
    file = _get(cfg, "prompts.path")
    _, starts = user_prompts(source, file, tokenizer, _get(cfg, "run.num_prompts"), _get(cfg, "run.prompt_tokens"),
                             _get(cfg, "run.max_new_tokens"))
    check_prompt_lengths(starts, _get(cfg, "run.max_new_tokens"), _get(cfg, "num_drafts"), longest,
                         f"prompts.path: {file}")


def check_grammar(cfg: Any) -> None:
    """The ``grammar`` group and ``source=jsonl`` lines' ``json_schema`` (experiments.grammars):
    the grammar read and parsed now (a file that is not there, a schema that is not JSON, a
    grammar xgrammar's parser refuses), and the settings a grammar cannot run with:

    - ``mode=teacher_forced``: it scores the corpus's own text, which no grammar constrains;
    - ``batch_size > 1``: the grammar loop runs one prompt at a time;
    - ``model.kind=random``: a grammar is compiled against the model's tokenizer, which a random
      model has not;
    - per-prompt schemas with a run grammar (``grammar=regex`` etc.): two constraints on one
      prompt (per-prompt schemas run with ``grammar=none``);
    - masked drafts (``grammar.drafts=masked``) on a backend whose ``propose`` (or, with
      ``draft=sampled``, ``propose_sampled``) takes no ``grammar``.

    Every temperature and ``draft`` combination the loop runs without a grammar runs with one:
    greedy verification masks the argmax, rejection sampling draws from the target's distribution
    over the allowed tokens against argmax or sampled drafts, masked or not (``draft=sampled``
    still needs ``temperature > 0``, as without a grammar).
    """
    node = cfg.get("grammar")
    if node is None:
        return
    from ..grammars import jsonl_schemas, run_grammar

    try:
        spec = run_grammar(node)
        schemas = []
        if _get(cfg, "source") == "jsonl" and (cfg.get("trace") or {}).get("path") is None:  # a replay reads no file
            schemas = [x for x in jsonl_schemas(_get(cfg, "prompts.path"), _get(cfg, "run.num_prompts")) if x]
    except ImportError as e:
        raise ValueError(str(e)) from None
    if spec is None and not schemas:
        if node.get("drafts", "masked") != "masked":  # how to draft under a grammar, and there is none
            raise ValueError(f"grammar.drafts={node.get('drafts')}: it says how the drafter drafts under a grammar, "
                             "and this run has none (grammar=none, no json_schema line): leave it unset")
        return
    what = f"grammar={spec.kind}" if spec is not None else "a source=jsonl json_schema"
    if spec is not None and schemas:
        raise ValueError(f"prompts.path's lines carry json_schema and grammar={spec.kind} would constrain them too: "
                         "per-prompt schemas run with grammar=none")
    if _get(cfg, "mode") != "speculative":
        raise ValueError(f"{what} constrains the speculative loop's output; mode={_get(cfg, 'mode')} scores the "
                         "corpus's own text, which no grammar constrains (mode=speculative)")
    if _get(cfg, "batch_size") != 1:
        raise ValueError(f"{what} runs one prompt at a time: batch_size must be 1, got {_get(cfg, 'batch_size')}")
    if (cfg.get("trace") or {}).get("path") is not None:
        raise ValueError(f"{what} constrains the target's greedy path, and trace.path holds the unconstrained one (a "
                         "trace records the target's own argmax): run a grammar against the live target")
    if float(_get(cfg, "temperature")) > 0 and (cfg.get("verify") == "match" or cfg.get("top_p") is not None
                                                or cfg.get("top_k") is not None):
        raise ValueError(f"{what} runs greedy or verify=rejection without top_p / top_k: verify=match's seeded "
                         "samples and the sampler's kept set are the unconstrained target's")
    if _get(cfg, "model.kind") == "random":
        raise ValueError(f"{what} is compiled against the model's tokenizer; model.kind=random has none (use "
                         "model=shipped, next_shipped or hf)")
    if node.get("drafts", "masked") == "masked":
        backend = _get(cfg, "backend.name")
        method = "propose_sampled" if draft_kind(cfg) == "sampled" else "propose"
        if not takes_grammar(backend, method):
            raise ValueError(f"grammar.drafts=masked drafts under the grammar, and backend={backend}'s {method} takes "
                             "no grammar (grammar.drafts=unmasked, or a backend that does)")


def takes_grammar(backend: str, method: str) -> bool:
    """Whether backend ``backend``'s ``method`` takes a ``grammar`` argument (DESIGN.md §10)."""
    import inspect

    try:
        cls = backend_class(backend)
    except ImportError:
        return False
    fn = getattr(cls, method, None)
    return fn is not None and "grammar" in inspect.signature(fn).parameters


def draft_kind(cfg: Any) -> str:
    return _get(cfg, "draft")


def model_config(cfg: Any) -> Any:
    """The ``model`` group's ``MtpConfig``, read now: a random preset by name, or the checkpoint's
    ``config.json`` (``model.path``, null: the shipped one), which must be a checkpoint folder."""
    from glm_mtp.reference import MtpConfig
    from glm_mtp.reference.checkpoint import check_checkpoint_directory

    kind = _get(cfg, "model.kind")
    if kind == "random":
        preset = _get(cfg, "model.preset")
        try:
            return MtpConfig.preset(preset)
        except (ValueError, TypeError) as e:
            raise ValueError(f"model.preset must be a preset name: {e}") from None
    path = _get(cfg, "model").get("path")
    if path is None and kind == "hf":
        raise ValueError("model.path must be a checkpoint directory for model=hf (config.json, safetensors, as "
                         "released)")
    if path is None:
        from ..targets.checkpoint import SHIPPED, shipped_checkpoint

        try:
            path = str(shipped_checkpoint(_get(cfg, "model").get("shipped") or SHIPPED))
        except FileNotFoundError as e:
            raise ValueError(f"model.shipped: {e}") from None
    if not isinstance(path, str):
        raise ValueError(f"model.path must be a checkpoint directory or null (the shipped checkpoint), got {path!r}")
    try:
        check_checkpoint_directory("model.path", path)
        config = MtpConfig.from_hf_config(path)
    except (OSError, ValueError) as e:
        message = str(e).removeprefix("model.path: ")
        raise ValueError("model.path must be a checkpoint directory (config.json and safetensors): "
                         f"{message}") from None
    # A replay (trace.path) reads the drafter's tensors only: the target's are neither needed nor checked.
    replay = (cfg.get("trace") or {}).get("path") is not None
    if kind == "hf" and not replay:
        from ..targets.hf_target import check_hf_checkpoint

        check_hf_checkpoint(path)
    from ..targets.checkpoint import check_checkpoint_loads

    check_checkpoint_loads("model.path", path, _get(cfg, "model.dtype"),
                           package_target=kind == "checkpoint" and not replay)
    return config


def check_lengths(cfg: Any, max_position_embeddings: int) -> None:
    """The rows a run needs fit the drafter and the target: ``prompt_tokens + max_new_tokens +
    num_drafts + 1 <= model.max_seq_len``, itself capped at the model's context."""
    longest = min(_get(cfg, "model.max_seq_len"), max_position_embeddings)
    keys = ("run.prompt_tokens", "run.max_new_tokens", "num_drafts")
    need = sum(_get(cfg, k) for k in keys) + 1
    if need > longest:
        cap = (
            f" (capped at the model's max_position_embeddings={max_position_embeddings})"
            if longest < _get(cfg, "model.max_seq_len")
            else ""
        )
        raise ValueError(f"num_drafts must fit model.max_seq_len: {' + '.join(keys)} + 1 = {need} exceeds "
                         f"model.max_seq_len={longest}{cap}")


def check_sampling_temperature(cfg: Any) -> None:
    """With sampled drafts, the drafter divides its logits by the temperature in A (float32, or
    float64 for float64 weights): the temperature must be a finite normal number there (the rule
    against the head's logit bound is the drafter's, at its first sampled propose)."""
    from glm_mtp.reference.contract import check_temperature
    from glm_mtp.reference.numerics import acc_dtype
    from glm_mtp.registry import DTYPES

    try:
        check_temperature(_get(cfg, "temperature"), 0.0, acc_dtype(DTYPES[_get(cfg, "model.dtype")]))
    except ValueError as e:
        raise ValueError(f"temperature must suit draft=sampled: {e}") from None


def check_train(cfg: Any) -> None:
    """The training run's settings (conf/train.yaml): the ``train`` and ``tokenizer`` groups."""
    for key, minimum in (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("warmup", 0), ("mtp_depth", 1),
                         ("log_every", 1), ("eval_every", 1), ("eval_windows", 1)):
        need_int(cfg, f"train.{key}", minimum)
    need_threads(cfg, "train.threads")
    need_seed(cfg, "train.seed")
    need_float(cfg, "train.max_minutes", 0.0, strict=True)
    need_float(cfg, "train.lr", 0.0, strict=True)
    need_float(cfg, "train.min_lr", 0.0)
    for key in ("weight_decay", "grad_clip", "mtp_loss_weight", "bias_update_rate"):
        need_float(cfg, f"train.{key}", 0.0)
    seq_len, depth = _get(cfg, "train.seq_len"), _get(cfg, "train.mtp_depth")
    if seq_len <= depth:
        raise ValueError(f"train.seq_len must be > train.mtp_depth ({depth}): MTP depth k trains on seq_len - k rows "
                         f"of each window, so depth {depth} would have none; got {seq_len}")
    distill = need_float(cfg, "train.mtp_distill", 0.0)
    if distill > 1:
        raise ValueError(f"train.mtp_distill must be in [0, 1], got {distill}")
    base = _get(cfg, "train").get("base")
    if (
        base is not None
        and base != "shipped"
        and not (isinstance(base, str) and os.path.isfile(os.path.join(base, "config.json")))
    ):
        raise ValueError(f"train.base must be null, shipped or a checkpoint directory (with config.json), got {base!r}")
    if "indexer_loss_weight" in _get(cfg, "train"):
        need_float(cfg, "train.indexer_loss_weight", 0.0)
    need_int(cfg, "tokenizer.vocab_size", 1)
    need_int(cfg, "tokenizer.sample_every", 1)
    tok_path = _get(cfg, "tokenizer").get("path")
    if (
        tok_path is not None
        and tok_path != "shipped"
        and not (isinstance(tok_path, str) and os.path.isfile(os.path.join(tok_path, "tokenizer.json")))
    ):
        raise ValueError("tokenizer.path must be null, shipped or a checkpoint directory (with tokenizer.json and "
                         f"corpus.json), got {tok_path!r}")
    if _get(cfg, "tokenizer.limit_items") is not None:
        need_int(cfg, "tokenizer.limit_items", 1)
    check_logger(cfg)
    check_tokenizer_vocab(cfg)
    check_base_reads(cfg, trained_model_config(cfg))
    out = _get(cfg, "out") if "out" in cfg else None
    if out is not None:
        check_out(out)


def check_tokenizer_vocab(cfg: Any) -> None:
    """``tokenizer.vocab_size`` is the size of the BPE a run trains; a run that reads a trained
    tokenizer instead (``train.base``, or ``tokenizer.path``) cannot honour another size, so the
    setting must state that tokenizer's (never silently ignored)."""
    from ..training.bpe import BpeTokenizer
    from ..targets.checkpoint import shipped_checkpoint

    base, path = _get(cfg, "train").get("base"), _get(cfg, "tokenizer").get("path")
    key, source = ("train.base", base) if base is not None else ("tokenizer.path", path)
    if source is None:
        return
    directory = str(shipped_checkpoint()) if source == "shipped" else source
    file = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"{key}={source} holds no tokenizer.json (the run reads its tokenizer)")
    size = BpeTokenizer.load(file).vocab_size
    asked = _get(cfg, "tokenizer.vocab_size")
    if asked != size:
        raise ValueError(f"tokenizer.vocab_size must be {size}, the size of the tokenizer {key}={source} reads (the "
                         f"run trains no tokenizer of its own, so it cannot honour another size), got {asked}")


def check_base_reads(cfg: Any, base_config: Any) -> None:
    """A run on a trained base (``train.base``) trains the base's model with the base's tokenizer
    and split, so the keys that would build another are honoured only where they state the
    base's: every ``arch.*`` must be the base's ``config.json`` value (``base_config``, an
    ``MtpConfig``), ``tokenizer.path`` null or a tokenizer with the base's bytes; and a run that
    trains no tokenizer (``train.base`` or ``tokenizer.path``) reads no ``tokenizer.sample_every``,
    refused when given. ``ValueError`` naming the key (never taken and dropped)."""
    from omegaconf import OmegaConf

    from .explicit import given_keys, same

    t, tok = _get(cfg, "train"), _get(cfg, "tokenizer")
    base, tok_path = t.get("base"), tok.get("path")
    if (base is not None or tok_path is not None) and given_keys(cfg, ["tokenizer.sample_every"]):
        key, source = ("train.base", base) if base is not None else ("tokenizer.path", tok_path)
        raise ValueError(f"tokenizer.sample_every={tok.sample_every!r} samples the texts a new BPE trains on, and "
                         f"{key}={source} reads a trained tokenizer (none is trained): leave it unset")
    if base is None:
        return
    arch = _get(cfg, "arch")
    values = OmegaConf.to_container(arch) if OmegaConf.is_config(arch) else dict(arch)
    for field, value in values.items():
        want = getattr(base_config, str(field), None)
        if not same(value, want):
            raise ValueError(f"arch.{field}={value!r}: train.base={base} trains a fresh MTP layer on the base's model, "
                             f"whose {field} is {want!r}; the run cannot honour another (set arch.{field}={want!r}, or "
                             "leave train.base null to train a new model)")
    if tok_path is not None:
        from ..targets.checkpoint import shipped_checkpoint

        def tokenizer_bytes(p: str) -> bytes:
            directory = str(shipped_checkpoint()) if p == "shipped" else p
            with open(os.path.join(directory, "tokenizer.json"), "rb") as f:
                return f.read()

        if tokenizer_bytes(str(tok_path)) != tokenizer_bytes(str(base)):
            raise ValueError(f"tokenizer.path={tok_path}: train.base={base} trains with the base's own tokenizer, "
                             "and this is another: leave tokenizer.path null")


def trained_model_config(cfg: Any) -> Any:
    """The ``MtpConfig`` a training run makes: from ``arch.*`` (checked, ``check_arch``) or, with
    ``train.base``, the base checkpoint's (its arch is used)."""
    from glm_mtp.reference import MtpConfig

    base = _get(cfg, "train").get("base")
    if base is None:
        return check_arch(cfg)
    if base == "shipped":
        from ..targets.checkpoint import shipped_checkpoint

        base = str(shipped_checkpoint())
    from ..targets.checkpoint import check_checkpoint_loads

    config = MtpConfig.from_hf_config(base)
    check_checkpoint_loads("train.base", base, "float32", package_target=True)  # the training reads it in float32
    return config


def check_arch(cfg: Any) -> Any:
    """``arch.*`` builds an ``MtpConfig`` (with the tokenizer's vocab_size) that the run can
    train at ``train.seq_len``: its own rules, named ``arch.<field>``, and the context rules."""
    import dataclasses

    from omegaconf import OmegaConf

    from glm_mtp.reference import MtpConfig

    arch = _get(cfg, "arch")
    values = OmegaConf.to_container(arch) if OmegaConf.is_config(arch) else dict(arch)
    fields = {f.name for f in dataclasses.fields(MtpConfig)}
    for key in values:
        if key not in fields or key == "vocab_size":
            raise ValueError(f"arch.{key} must be a field of MtpConfig (vocab_size comes from tokenizer.vocab_size), "
                             "got an unknown key")
    try:
        mcfg = MtpConfig(**values, vocab_size=_get(cfg, "tokenizer.vocab_size"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"arch must describe a valid model: {e}") from None
    seq_len = _get(cfg, "train.seq_len")
    if seq_len > mcfg.index_topk and not mcfg.is_next:
        raise ValueError(f"train.seq_len must be <= arch.index_topk ({mcfg.index_topk}): GLM-5's indexer is not "
                         f"trained (arch.family=glm5_next trains its KPool indexer), got {seq_len}")
    if seq_len + 1 > mcfg.max_position_embeddings:
        raise ValueError(f"train.seq_len must be < arch.max_position_embeddings ({mcfg.max_position_embeddings}), got "
                         f"{seq_len}")
    return mcfg


def check_out(out: object) -> None:
    """Where a trained checkpoint goes: a path a save may replace (``checkpoint.check_save_target``),
    in a writable folder."""
    from glm_mtp.reference.checkpoint import check_save_target

    if not isinstance(out, str) or not out:
        raise ValueError(f"out must be a directory path or null, got {out!r}")
    try:
        target = check_save_target(out)
    except ValueError as e:
        raise ValueError("out must be a new folder, an empty one or a checkpoint: "
                         f"{str(e).removeprefix('save: ')}") from None
    why = unwritable_dir(os.path.dirname(target))
    if why is not None:
        raise ValueError(f"out must be in a writable folder: {why}")


def check_grid(cfg: Any) -> None:
    """The training grid's settings (conf/grid.yaml): the training's, and the evaluation's. ``out``
    is refused: each job writes its checkpoint into its own run folder (``<run dir>/checkpoint``),
    so a given one would be dropped."""
    if cfg.get("out") is not None:
        raise ValueError(f"out={cfg.out!r}: each grid job writes its checkpoint into its own run folder "
                         "(<run dir>/checkpoint), so the grid takes no out: leave it unset")
    check_train(cfg)
    runs = _get(cfg, "eval.runs")
    if not hasattr(runs, "items") or not len(runs):
        raise ValueError(f"eval.runs must map run names to lists of acceptance overrides, got {runs!r}")
    for name, ov in runs.items():
        if isinstance(ov, str) or not all(isinstance(x, str) for x in ov):
            raise ValueError(f"eval.runs.{name} must be a list of overrides (strings), got {ov!r}")
    common = _get(cfg, "eval.common")
    if isinstance(common, str) or not all(isinstance(x, str) for x in common):
        raise ValueError(f"eval.common must be a list of overrides (strings), got {common!r}")
    need_int(cfg, "eval.feed_prompts", 1)


def unwritable_dir(path: str) -> str | None:
    """Why files could not be written into the folder ``path`` (made if missing), or ``None``."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # the nearest existing ancestor is where the folder gets made
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{path}: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{path}: {probe} is not writable"
    return None


# What Hydra writes into a run directory before the task function runs.
HYDRA_FILES = (".hydra",)


def remove_hydra_run_dir(run_dir: str) -> None:
    """Remove what Hydra put into ``run_dir`` (``.hydra/`` and the job's log file), then the
    folder itself if that leaves it empty; anything else is left alone."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if name in HYDRA_FILES and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".log") and os.path.isfile(path) and os.path.getsize(path) == 0:
            os.remove(path)
    if not os.listdir(run_dir):
        os.rmdir(run_dir)
        remove_empty_parents(run_dir)


def remove_empty_parents(path: str) -> None:
    """Remove the folders above ``path`` that are left empty, up to the working directory (Hydra
    makes ``outputs/<name>/`` or ``multirun/`` on the way to a run's folder); stops at the first
    that holds anything, and never leaves the working directory."""
    here = os.path.abspath(os.getcwd())
    parent = os.path.dirname(os.path.abspath(path))
    while parent != here and parent.startswith(here + os.sep) and os.path.isdir(parent) and not os.listdir(parent):
        os.rmdir(parent)
        parent = os.path.dirname(parent)


def _sweep_dir() -> str | None:
    """The sweep folder of a Hydra multirun job, or ``None`` (a single run, or no Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    except Exception:  # no Hydra context: called outside a Hydra main
        return None


def exit_on_bad_config(check: Callable[[Any], None], cfg: Any, run_dir: str, prog: str) -> None:
    """Run ``check(cfg)``; on a ``ValueError`` print ``prog: error: <why>``, remove the run
    directory Hydra made (``remove_hydra_run_dir``; in a multirun also the sweep folder when
    only Hydra's ``multirun.yaml`` is left in it) and exit with status 2."""
    try:
        check(cfg)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        remove_hydra_run_dir(run_dir)
        sweep = _sweep_dir()
        if sweep and os.path.isdir(sweep) and set(os.listdir(sweep)) <= {"multirun.yaml"}:
            shutil.rmtree(sweep, ignore_errors=True)
            remove_empty_parents(sweep)
        sys.exit(2)
