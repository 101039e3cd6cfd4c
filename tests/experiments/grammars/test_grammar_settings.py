"""Grammars in the acceptance experiment (experiments.grammars, conf/grammar/): compiled against
the package's BPE and transformers' tokenizers, refused in one line before any work when they
cannot run (the entry point's exit 2 for one of them: tests/test_commands_refuse_first.py), and
recorded in summary.json and W&B (kind, sha256, forbidden drafts)."""

import hashlib
import json
import re

import pytest
import torch
from hydra import compose, initialize_config_module

pytest.importorskip("xgrammar")

from glm_mtp.experiments.acceptance_job.run import run as run_acceptance  # noqa: E402
from glm_mtp.experiments.grammars import GrammarSpec  # noqa: E402
from glm_mtp.experiments.grammars.compile import GrammarCompiler  # noqa: E402
from glm_mtp.experiments.loop.grammar_verify import matcher_row  # noqa: E402
from glm_mtp.experiments.settings.validate import check_acceptance  # noqa: E402
from glm_mtp.experiments.targets.checkpoint import load_checkpoint, shipped_checkpoint  # noqa: E402

TIGHT = "[a-z_ .()=,\\n]*"  # the grammar: lower-case Python without digits, quotes or colons


def config(overrides):
    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture(scope="module")
def shipped():
    return load_checkpoint(shipped_checkpoint("glm5-mtp-stdlib"))


def test_the_bpe_vocabulary_compiles_and_each_mask_is_the_regex_over_token_bytes(shipped):
    V = shipped.mtp.config.vocab_size
    compiler = GrammarCompiler(shipped.tokenizer, V)
    m = compiler.matcher(GrammarSpec("regex", TIGHT, "inline"))
    allowed = matcher_row(m, V)
    ok = re.compile(rb"[a-z_ .()=,\n]*")
    want = torch.tensor([ok.fullmatch(b) is not None and len(b) > 0 for b in shipped.tokenizer.vocab]
                        + [False] * (V - len(shipped.tokenizer.vocab)))
    assert torch.equal(allowed, want) and 0 < int(want.sum()) < V
    # after a token, the same set (the grammar is a star); the matcher walks token ids
    word = shipped.tokenizer.encode("self.x = f(a, b)\n")
    for t in word:
        assert m.accept_token(t)
    assert not m.accept_token(shipped.tokenizer.encode("A")[0])


def test_transformers_tokenizer_compiles_a_json_schema(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from glm_mtp.experiments.targets.hf_target import HfTokenizer

    from ..hf_checkpoints import write_tokenizer

    write_tokenizer(str(tmp_path))
    tok = HfTokenizer(AutoTokenizer.from_pretrained(str(tmp_path)))
    compiler = GrammarCompiler(tok, 96)
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    m = compiler.matcher(GrammarSpec("json_schema", schema, "inline"))
    assert torch.nonzero(matcher_row(m, 96)).flatten().tolist() == tok.encode("{")
    for t in tok.encode('{"n": 12}'):
        assert m.accept_token(t)
    assert not matcher_row(m, 96).any()  # complete; the char vocabulary has no stop token: nothing more
    s = compiler.matcher(GrammarSpec("json_schema", '{"type": "string"}', "inline"))
    assert s.accept_token(tok.encode('"')[0])
    inside = matcher_row(s, 96)
    assert inside[tok.encode("a")[0]] and not inside[tok.tokenizer.pad_token_id]  # a special token is never text


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case, overrides, message", [
    ("bad regex", ["grammar=regex", "grammar.pattern='[a-'"], "grammar.pattern: not a valid regex grammar"),
    ("bad ebnf", ["grammar=ebnf", "grammar.pattern='root ::= foo'"], 'Rule "foo" is not defined'),
    ("schema not JSON", ["grammar=json_schema", "grammar.path={schema}"], "a json_schema must be JSON"),
    ("schema a list", ["grammar=json_schema", "grammar.pattern='[1]'"], "must be a JSON object"),
    ("no file", ["grammar=regex", "grammar.path=/nonexistent/g.regex"], "grammar.path must be a file"),
    ("no text", ["grammar=regex"], "exactly one of grammar.path=FILE or grammar.pattern=TEXT"),
    ("two texts", ["grammar=regex", "grammar.pattern=a", "grammar.path={schema}"], "exactly one of"),
    ("text without kind", ["grammar.pattern=a"], "choose its kind too"),
    ("drafts", ["grammar=regex", "grammar.pattern=a", "grammar.drafts=some"], "grammar.drafts must be one of"),
    ("teacher forced", ["grammar=regex", "grammar.pattern=a", "mode=teacher_forced"], "mode=teacher_forced scores"),
    ("batched", ["grammar=regex", "grammar.pattern=a", "batch_size=2"], "batch_size must be 1"),
    ("random model", ["grammar=regex", "grammar.pattern=a", "model=tiny_random"], "model.kind=random has none"),
    ("jsonl and run grammar", ["grammar=regex", "grammar.pattern=a", "source=jsonl", "prompts.path={jsonl}"],
     "per-prompt schemas run with grammar=none"),
    ("jsonl schema not JSON", ["source=jsonl", "prompts.path={bad_jsonl}"], ':1: "json_schema": a json_schema must'),
])
def test_a_grammar_that_cannot_run_is_one_line_before_any_work(tmp_path, case, overrides, message):
    prompt = "import os\nprint(os.sep)\n"  # long enough to measure: the prompt rules pass, the grammar's decide
    files = {"schema": write(tmp_path / "s.json", "{not json"),
             "jsonl": write(tmp_path / "p.jsonl", json.dumps({"prompt": prompt, "json_schema": {"type": "string"}})),
             "bad_jsonl": write(tmp_path / "q.jsonl", json.dumps({"prompt": prompt, "json_schema": "{nope"}))}
    cfg = config([o.format(**files) for o in overrides] + ["logger=none"])
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        check_acceptance(cfg)
    assert "\n" not in str(e.value), case


def test_masked_drafts_need_a_backend_that_takes_the_grammar(monkeypatch):
    from glm_mtp.experiments.settings import validate

    monkeypatch.setattr(validate, "takes_grammar", lambda backend, method: False)
    with pytest.raises(ValueError, match="backend=reference's propose takes no grammar"):
        check_acceptance(config(["model=shipped", "grammar=regex", "grammar.pattern=a", "logger=none"]))
    check_acceptance(config(["model=shipped", "grammar=regex", "grammar.pattern=a", "grammar.drafts=unmasked",
                             "logger=none"]))


def test_a_run_under_a_grammar_records_it_and_counts_forbidden_drafts(tmp_path, monkeypatch):
    """summary.json and the (offline) W&B run record the grammar and the forbidden drafts."""
    from glm_mtp.experiments.reporting.wandb_log import read_offline_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    path = write(tmp_path / "g.regex", TIGHT + "\n")  # the file's final newline ends its line
    cfg = config(["model=shipped", "grammar=regex", f"grammar.path={path}", "grammar.drafts=unmasked",
                  "experiment=smoke", "logger=wandb", "speedup.costs=glm5"])
    check_acceptance(cfg)
    s = run_acceptance(cfg, str(tmp_path / "run"))
    assert s["grammar"] == {"kind": "regex", "sha256": hashlib.sha256(TIGHT.encode()).hexdigest(), "origin": path,
                            "drafts": "unmasked"}
    assert s["lossless"]["identical"] == 2 and s["forbidden_drafts"] > 0
    assert s["forbidden_drafts"] == sum(s["counts_per_prompt"]["forbidden"])
    assert s["wasted_verify_slots"] >= s["forbidden_drafts"]
    for sample in s["samples"]:
        assert re.fullmatch(r"[a-z_ .()=,\n]*", sample["continuation"])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["grammar"] == s["grammar"]
    logged = read_offline_run(str(tmp_path / "run"))["summary"]
    assert logged["grammar"]["kind"] == "regex" and logged["grammar"]["sha256"] == s["grammar"]["sha256"]
    assert logged["forbidden_drafts"] == s["forbidden_drafts"]


def test_the_report_pairs_masked_and_unmasked_runs_on_the_same_prompts():
    from glm_mtp.experiments.loop.stats import paired_ratio_difference
    from glm_mtp.experiments.report import grammar_table

    def run(drafts, reached, accepted, steps, wasted, forbidden, out="abc"):
        return {"mode": "speculative", "source": "heldout", "backend": "reference", "temperature": 0.0,
                "feed_hidden": "post_norm", "policy": "first_row_kept", "num_drafts": 2, "prompts": 2,
                "checkpoint": "/x/glm5-mtp-stdlib", "prompts_sha256": "p", "outputs_sha256": out,
                "grammar": {"kind": "regex", "sha256": "f" * 64, "origin": "inline", "drafts": drafts},
                "forbidden_drafts": sum(forbidden), "counts": {"steps": sum(steps)},
                "counts_per_prompt": {"reached": reached, "accepted": accepted, "steps": steps, "wasted": wasted,
                                      "forbidden": forbidden}}

    masked = run("masked", [[4, 2], [2, 1]], [[2, 1], [1, 0]], [4, 2], [4, 2], [0, 0])
    unmasked = run("unmasked", [[6, 1], [3, 0]], [[1, 0], [0, 0]], [6, 3], [11, 6], [5, 2])
    d = paired_ratio_difference(masked["counts_per_prompt"], unmasked["counts_per_prompt"], "wasted", "steps")
    assert d["diff"] == pytest.approx(6 / 6 - 17 / 9) and d["ci"][0] <= d["diff"] <= d["ci"][1]
    table = grammar_table([unmasked, masked]).splitlines()
    assert len(table) == 3 and "| glm5-mtp-stdlib | regex ffffffff | 2 | yes | 0.78 |" in table[2]
    assert f"{6 / 6 - 17 / 9:+.3f}" in table[2]
    assert "| no |" in grammar_table([masked, run("unmasked", [[6, 1], [3, 0]], [[1, 0], [0, 0]], [6, 3], [11, 6],
                                                  [5, 2], out="xyz")])
    assert grammar_table([masked]) == ""  # no pair


def test_tau_counts_the_verification_that_ends_an_output_without_a_bonus():
    from glm_mtp.experiments.loop.stats import bootstrap, paired_difference

    counts = {"reached": [[3, 1], [2, 0]], "accepted": [[1, 0], [0, 0]], "steps": [3, 2]}
    ended = {**counts, "committed": [3, 1]}  # each prompt's last verification committed no bonus
    assert bootstrap(counts)["tau_ci"][0] >= 1.0  # a bonus every step: tau >= 1
    lo, hi = bootstrap(ended)["tau_ci"]
    assert lo <= 4 / 5 <= hi <= 1.0 and lo < 0.9  # 3 / 3 and 1 / 2 per prompt
    assert paired_difference(ended, {**counts, "committed": [4, 2]})["tau"] == pytest.approx(4 / 5 - 6 / 5)
