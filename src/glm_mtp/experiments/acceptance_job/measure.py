"""One acceptance run's measuring: load the model (or open a trace and load the drafter alone),
build the prompts, run the speculative loop (or teacher forcing) over them and count."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import torch

from ..loop.recall import ProbedProposer, RecallProbe, selection
from ..loop.speculative import (SpecStats, SpeculativeDecoder, make_proposer, speculative_results, target_decode,
                                teacher_forced)
from ..loop.stop_rules import stop_rule
from ..reporting.measured import MeasuredFile
from ..settings.model import apply_drafter_settings, load_model, make_target
from ..settings.prompts import check_prompt_lengths
from ..settings.sampling import decoder_sampling
from ..settings.validate import check_attention
from ..settings.windows import run_prompts
from .measurement import Measurement
from .run_grammars import run_grammars


def measure(cfg: Any, measured: MeasuredFile | None = None) -> Measurement:
    """Load the model, build the prompts and run the loop (or teacher forcing) over them.

    Args:
        cfg: the run's config; it has passed ``settings.validate.check_acceptance`` (the entry
            point runs it first), so it is read here, not re-checked.
        measured: where each prompt's counts go as it finishes (``reporting.measured``); None:
            nowhere.
    """
    mode, source = cfg.get("mode", "speculative"), cfg.get("source", "heldout")
    batch_size = cfg.get("batch_size", 1)
    torch.set_num_threads(cfg.threads)
    # The drafter logs every prefill at INFO; one line per prompt drowns the table.
    logging.getLogger("glm_mtp").setLevel(logging.WARNING)
    run = cfg.run
    draft, numerics = cfg.get("draft", "argmax"), cfg.get("target_numerics", "vendor")
    trace = None
    # Target | HfTarget | ReplayTarget: each takes its own state type, which loop.round.TargetModel's
    # ``state: object`` parameters cannot name (a method's parameter types are contravariant)
    target: Any
    device: torch.device | str
    if (cfg.get("trace") or {}).get("path") is not None:  # a replay: the drafter alone, the trace's prompts
        from ..targets.replay import ReplayTarget
        from ..traces.replay_run import load_drafter, open_for_replay, replay_prompts

        model = apply_drafter_settings(load_drafter(cfg.model), cfg.model)
        trace = open_for_replay(cfg, model.mtp.config)
        source = trace.meta.get("prompts", {}).get("source", source)
        rp = replay_prompts(trace, run.max_new_tokens, cfg.num_drafts)
        windows, starts, prompt_lens, budgets = rp.windows, rp.starts, rp.prompt_lens, rp.budgets
        max_seq_len = min(cfg.model.max_seq_len, model.mtp.config.max_position_embeddings)
        numerics = trace.meta["target"].get("numerics", "recorded")
        target, device = ReplayTarget(trace, model.mtp.device), model.mtp.device
    else:
        model = load_model(cfg.model)
        windows, starts = run_prompts(cfg, model, source)
        prompt_lens, budgets = [run.prompt_tokens] * len(windows), [run.max_new_tokens] * len(windows)
        max_seq_len = min(cfg.model.max_seq_len, model.mtp.config.max_position_embeddings)
        check_prompt_lengths(starts, run.max_new_tokens, cfg.num_drafts, max_seq_len, "prompts")
        if model.hf is not None:
            numerics = "transformers"
        target, device = make_target(cfg, model, max_seq_len, numerics)
    attention = check_attention(cfg.get("attention", "sparse"), cfg.backend.name, model.mtp.config)
    probe = None
    if model.mtp.config.is_next and cfg.backend.name == "reference":  # the selection, and its recall recorded
        probe = RecallProbe(model.mtp, selection(attention))
        proposer = make_proposer(cfg.backend.name, model.mtp, max_seq_len, cfg.feed_hidden, kpool=probe)
    else:
        proposer = make_proposer(cfg.backend.name, model.mtp, max_seq_len, cfg.feed_hidden)
    drafter = proposer if probe is None else ProbedProposer(proposer, probe)
    grammars = run_grammars(cfg, model, len(starts))
    stop = stop_rule(cfg)
    sampling = decoder_sampling(cfg)
    decoder = SpeculativeDecoder(target, drafter, cfg.num_drafts, cfg.policy, cfg.temperature, cfg.seed, draft,
                                 "masked" if grammars is None else grammars.drafts, stop, **sampling)

    stats = SpecStats(cfg.num_drafts)
    per_prompt: list[SpecStats] = []
    generated, grams, distinct = 0, 0, 0
    # greedy: against the target's greedy decode; verify=match: against its own seeded sampling
    seeded = decoder.rules.sampler if decoder.seeded else None
    check_lossless = bool(run.check_lossless) and mode == "speculative" and (cfg.temperature == 0 or seeded is not None)
    divergences: list[dict[str, int]] = []  # per prompt that parts from the target's own (seeded) decode
    samples: list[dict[str, Any]] = []
    outputs: list[list[int]] = []  # each prompt's generated tokens
    decode = model.tokenizer.decode if model.tokenizer is not None else str
    t0 = time.perf_counter()
    results = speculative_results(decoder, starts, budgets, batch_size, device, grammars)
    for w, plen, want in zip(windows, prompt_lens, budgets):
        before = generated
        if mode == "teacher_forced":
            st = teacher_forced(target, drafter, w, plen, cfg.num_drafts, cfg.policy, cfg.temperature,
                                decoder.gen,
                                device=device, draft=draft, stop=stop, **sampling, seed=cfg.seed)
            if len(samples) < 2:
                samples.append({"prompt": decode(w[:plen]),
                                "continuation": decode(w[plen:]),
                                "steps": st.steps, "accepted": st.accepted})
        else:
            p, res = next(results)
            st = res.stats
            generated += len(res.tokens)
            outputs.append(res.tokens)
            four = [tuple(res.tokens[i : i + 4]) for i in range(len(res.tokens) - 3)]
            grams, distinct = grams + len(four), distinct + len(set(four))
            if check_lossless:  # the target's own (constrained, under a grammar) greedy or seeded decode
                if grammars is None:
                    plain = (target_decode(target, p, want) if seeded is None
                             else target_decode(target, p, want, seeded=seeded))
                else:
                    plain = target_decode(target, p, want, matcher=grammars.matcher(len(per_prompt)),
                                          vocab_size=model.mtp.config.vocab_size)
                if res.tokens != plain:  # first differing token; the shorter's length when one is the other's prefix
                    at = next((i for i, (x, y) in enumerate(zip(res.tokens, plain)) if x != y),
                              min(len(res.tokens), len(plain)))
                    divergences.append({"prompt": len(per_prompt), "token": at})
            if len(samples) < 2:
                samples.append({"prompt": decode(p), "continuation": decode(res.tokens), "steps": st.steps,
                                "accepted": st.accepted})
        stats.merge(st)
        per_prompt.append(st)
        if measured is not None:
            measured.append(st, generated - before)
    return Measurement(mode=mode, source=source, batch_size=batch_size, draft=draft, numerics=numerics, model=model,
                       target=target, proposer=proposer, windows=windows, stats=stats, per_prompt=per_prompt,
                       generated=generated, grams=grams, distinct=distinct, check_lossless=check_lossless,
                       divergences=divergences, samples=samples, wall=time.perf_counter() - t0, attention=attention,
                       recall=None if probe is None else probe.records, grammars=grammars,
                       outputs_sha256=hashlib.sha256(json.dumps(outputs).encode()).hexdigest() if outputs else None,
                       trace=trace)
