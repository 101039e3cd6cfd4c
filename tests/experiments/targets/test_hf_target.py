"""The released checkpoint's own target, run by transformers, under the loop (``hf_target.HfTarget``).

On tiny random checkpoints of both families in the release layout (``hf_checkpoints``): the
glm5_next one has KDA linear layers, DSA layers in mHC hyper-connections and a layer sharing its
predecessor's selection; the glm_moe_dsa one DSA layers. In float32:

- greedy speculative decoding equals greedy decoding by the same model, token for token, for the
  three rollback policies, and that decoding equals the no-cache forward's argmax;
- teacher-forced counts equal counts made from no-cache forwards;
- a rollback of a whole verify restores the cache byte for byte; rollbacks and verifies the
  recorded window cannot make exact are refused, state untouched; a verify longer than the window
  (a mutant with the rule switched off) restores a wrong state, which the byte check catches.

The indexer's top-k ties go to the lower index (``topk_ties='lower_index'``, DESIGN.md §6):
relu-0 scores tie exactly, and torch's top-k breaks them differently at different query counts.
Drafts come from an oracle that knows the target's greedy continuation and spoils some of it, so
every accept count occurs; the drafter state is the real reference drafter's.
"""

import copy
import json
import random
import sys

import pytest
import torch

pytest.importorskip("transformers")

from glm_mtp.experiments.targets.hf_target import HfTarget, load_hf_model, require_transformers  # noqa: E402
from glm_mtp.experiments.loop import speculative  # noqa: E402
from glm_mtp.experiments.settings.prompts import path_sha256  # noqa: E402
from glm_mtp.experiments.loop.speculative import SpeculativeDecoder, target_decode, teacher_forced  # noqa: E402
from glm_mtp.reference import MtpWeights, ReferenceProposer  # noqa: E402
from glm_mtp.reference.bytes import same_bytes  # noqa: E402

from ..hf_checkpoints import FAMILIES, write_hf_checkpoint  # noqa: E402

K = 3


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp(request.param) / "ck"
    write_hf_checkpoint(directory, request.param)
    hf = load_hf_model(str(directory), "cpu", torch.float32)
    return request.param, directory, hf, MtpWeights.from_pretrained(directory, dtype=torch.float32)


def no_cache_argmax(hf, tokens):
    """Each position's argmax from one forward over ``tokens`` without a cache (ties pinned)."""
    from glm_mtp.experiments.targets.hf_target import pinned_topk

    with torch.no_grad(), pinned_topk("lower_index"):
        hidden = hf.model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        return hf.model.lm_head(hidden).argmax(-1).tolist()


class Oracle(ReferenceProposer):
    """The reference drafter (its state is real) with drafts from the target's known greedy
    continuation ``text``, each spoiled with probability ``p_wrong``."""

    def __init__(self, weights, text, p_wrong, seed):
        super().__init__(weights, max_seq_len=128)
        self.text, self.p_wrong, self.rng = text, p_wrong, random.Random(seed)

    def propose(self, last_token, target_hidden, position, num_drafts, state):
        super().propose(last_token, target_hidden, position, num_drafts, state)
        truth = self.text[position + 2 : position + 2 + num_drafts]
        return [(t + 1) % self.config.vocab_size if self.rng.random() < self.p_wrong else t for t in truth]


@pytest.fixture(scope="module")
def greedy(tiny):
    """A prompt, the model's greedy decode of 20 tokens after it, and the target."""
    _, _, hf, _ = tiny
    target = HfTarget(hf.model, K + 1, 128)
    prompt = torch.randint(96, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    out = target_decode(target, prompt, 20)
    return prompt, out, target


def test_greedy_decoding_equals_the_no_cache_forward(tiny, greedy):
    _, _, hf, _ = tiny
    prompt, out, _ = greedy
    assert no_cache_argmax(hf, prompt + out)[len(prompt) - 1 : -1] == out
    assert len(set(out)) > 5  # not a constant continuation


@pytest.mark.parametrize("policy", ["first_row_kept", "refeed", "trim_all"])
def test_speculative_greedy_equals_greedy_decoding(tiny, greedy, policy, monkeypatch):
    _, _, _, weights = tiny
    prompt, out, target = greedy
    oracle = Oracle(weights, prompt + out + [0] * K, 0.25, seed=7)
    accepts = []
    dec = SpeculativeDecoder(target, oracle, K, policy)
    real = speculative.play_round
    monkeypatch.setattr(speculative, "play_round",
                        lambda *a, **kw: (accepts.append((r := real(*a, **kw)).accepted) or r))
    res = dec.generate(prompt, len(out))
    assert res.tokens == out
    assert set(accepts) == {0, 1, 2, 3}  # every accept count, rollbacks of every size


def test_teacher_forced_counts_equal_no_cache_counts(tiny):
    _, _, hf, weights = tiny
    text = torch.randint(96, (15,), generator=torch.Generator().manual_seed(5)).tolist()
    n = 8
    greedy_next = no_cache_argmax(hf, text)  # row m: the target's token after text[:m+1]
    drafted = {}

    class Recorded(ReferenceProposer):
        """Drafts the target's next token (spoiled sometimes), then random ones; records them."""

        rng = random.Random(2)

        def propose(self, last_token, target_hidden, position, num_drafts, state):
            super().propose(last_token, target_hidden, position, num_drafts, state)
            if not num_drafts:
                return []
            m = position + 1
            first = greedy_next[m] if self.rng.random() < 0.7 else (greedy_next[m] + 1) % 96
            second = no_cache_argmax(hf, text[: m + 1] + [first])[-1]
            d = [first, second if self.rng.random() < 0.7 else (second + 1) % 96, self.rng.randrange(96)]
            drafted[m] = d
            return d

    stats = teacher_forced(HfTarget(hf.model, K + 1, 128), Recorded(weights, 128), text, n, K)
    reached, accepted = [0] * K, [0] * K
    for m, d in drafted.items():
        best = no_cache_argmax(hf, text[: m + 1] + d)[m:]
        a = next((i for i in range(K) if d[i] != best[i]), K)
        for i in range(min(a + 1, K)):
            reached[i] += 1
        for i in range(a):
            accepted[i] += 1
    assert stats.steps == len(text) - n == len(drafted)
    assert (stats.reached, stats.accepted) == (reached, accepted)
    assert 0 < accepted[1] < accepted[0] < stats.steps


def cache_tensors(state):
    """Every tensor the cache holds, by layer and attribute (conv and recurrent states included)."""
    out = {}
    for i, layer in enumerate(state.cache.layers):
        for name in ("keys", "values", "indexer_keys"):
            if getattr(layer, name, None) is not None:
                out[f"{i}.{name}"] = getattr(layer, name)
        for name in ("conv_states", "recurrent_states"):
            held = getattr(layer, name, None) or {}
            for j, t in (held.items() if isinstance(held, dict) else enumerate(held)):
                if isinstance(t, torch.Tensor):
                    out[f"{i}.{name}.{j}"] = t
    return out


def assert_same_cache(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert same_bytes(a[name], b[name]), name


def prefilled(target, n=13):
    state = target.alloc_state()
    target.prefill(torch.randint(96, (n,), generator=torch.Generator().manual_seed(n)).tolist(), state)
    return state


def test_rolling_back_a_whole_verify_restores_the_cache_byte_for_byte(tiny):
    _, _, hf, _ = tiny
    target = HfTarget(hf.model, K + 1, 128)
    state = prefilled(target)
    before = copy.deepcopy(cache_tensors(state))
    target.verify([5, 6, 7, 8], state)
    target.rollback(state, 13)
    assert state.length == 13 and state.cache.get_seq_length() == 13
    assert_same_cache(cache_tensors(state), before)


def rollback_error(hf, target, prompt):
    """Verify 4 tokens, roll back 2, verify 1: the largest logit difference from a no-cache forward."""
    state = target.alloc_state()
    target.max_verify = 4  # the mutant's: more than its states record
    target.prefill(prompt, state)
    target.verify([5, 6, 7, 8], state)
    target.rollback(state, len(prompt) + 2)
    got = target.verify([9], state).logits[-1]
    from glm_mtp.experiments.targets.hf_target import pinned_topk

    with torch.no_grad(), pinned_topk("lower_index"):
        want = hf.model.lm_head(hf.model.model(input_ids=torch.tensor([prompt + [5, 6, 9]])).last_hidden_state[0, -1])
    return float((got - want).abs().max())


def test_a_verify_longer_than_the_recorded_window_would_restore_a_wrong_state(tiny):
    # Mutant: the window rule switched off (states record 2 states, the verify feeds 4), so crop
    # restores the state before the verify where the one 2 tokens in was due.
    family, _, hf, _ = tiny
    prompt = list(range(20, 33))
    assert rollback_error(hf, HfTarget(hf.model, 4, 128), prompt) < 1e-4
    err = rollback_error(hf, HfTarget(hf.model, 2, 128), prompt)
    # glm5_next's KDA layers restore a recorded state, the wrong one; GLM-5's DSA layers keep rows.
    assert (err > 1e-2) == (family == "glm5_next"), err


def test_rollbacks_it_cannot_make_exact_are_refused_state_untouched(tiny):
    _, _, hf, _ = tiny
    target = HfTarget(hf.model, K + 1, 128)
    state = prefilled(target)
    with pytest.raises(ValueError, match="max_verify=4"):
        target.verify([1, 2, 3, 4, 5], state)
    target.verify([1, 2], state)
    target.verify([3, 4], state)  # settles [1, 2]
    snapshot = copy.deepcopy(cache_tensors(state))
    for length in (14, 12, 0, 18):  # into the settled verify, the prompt, before 0, past the end
        with pytest.raises(ValueError, match="reaches only into the last verify"):
            target.rollback(state, length)
        assert state.length == 17
        assert_same_cache(cache_tensors(state), snapshot)
    with pytest.raises(ValueError, match="empty state"):
        target.prefill([1], state)
    with pytest.raises(ValueError, match="prefilled"):
        target.verify([1], target.alloc_state())


def test_a_missing_transformers_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError) as e:
        require_transformers()
    assert "pip install 'glm-mtp[hf]'" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# The acceptance experiment with model=hf


def config(overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="glm_mtp.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


CLASSES = {"glm5_next": "Glm5NextForConditionalGeneration", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def test_acceptance_runs_model_hf_on_the_users_prompts(tiny, tmp_path):
    """glm5_next: the loop on a JSONL file's prompts (text and chat), lossless checked; GLM-5:
    teacher forcing on a folder of plain text. Both record the target and the prompts' file."""
    import transformers

    from glm_mtp.experiments.acceptance_job.run import run as run_acceptance
    from glm_mtp.experiments.settings import validate
    from glm_mtp.experiments.targets.provenance import file_sha256

    family, directory, _, _ = tiny
    common = ["model=hf", f"model.path={directory}", "logger=none", "num_drafts=2", "run.num_prompts=2",
              "run.max_new_tokens=10",
              "speedup.repeats=1", "speedup.costs=" + ("glm5" if family == "glm5_next" else "measured")]
    if family == "glm5_next":
        path = tmp_path / "prompts.jsonl"
        path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n\n" + json.dumps({"messages": [{"role": "user",
                                                                                                 "content": "Hi"}]})
                        + "\n" + json.dumps({"prompt": "never read: past run.num_prompts"}) + "\n")
        cfg = config(common + ["source=jsonl", f"prompts.path={path}", "run.check_lossless=true"])
        sha = file_sha256(path)
    else:
        path = tmp_path / "texts"
        path.mkdir()
        (path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 3)
        (path / "b.txt").write_text("import os\nprint(os.getcwd())\n" * 3)
        cfg = config(common + ["source=text", f"prompts.path={path}", "mode=teacher_forced", "run.prompt_tokens=12",
                               "policy=trim_all"])
        sha = path_sha256(str(path))
    validate.check_acceptance(cfg)
    s = run_acceptance(cfg, str(tmp_path / "run"))
    assert s["prompts"] == 2 and s["prompts_file_sha256"] == sha and s["prompts_path"] == str(path)
    assert s["target"] == {"implementation": "transformers", "transformers_version": transformers.__version__,
                           "class": CLASSES[family], "model_type": family,
                           "config_sha256": file_sha256(directory / "config.json"),
                           "device": "cpu", "device_map": {"": "cpu"}, "dtype": "float32", "topk_ties": "lower_index"}
    if family == "glm5_next":
        assert s["lossless"] == {"prompts": 2, "identical": 2, "diverged": []} and s["generated_tokens"] == 20
    else:  # the speedup model's costs timed on transformers' target: verifies of 1 to k + 1 tokens, rolled back
        assert s["scored_positions"] == 2 * 10 and s["lossless"] is None
        assert s["speedup"]["costs"] == "measured" and len(s["speedup"]["cost_details"]["verify_ms"]) == 2


def test_bad_model_hf_and_prompt_settings_are_one_line():
    from omegaconf import OmegaConf

    from glm_mtp.experiments.settings import validate

    base = config(["logger=none", "model=hf"])
    for changes, message in (
        ({}, "model.path must be a checkpoint directory for model=hf"),
        ({"model.path": ".", "model.device": "tpu"}, "model.device must be one of cpu, cuda, auto"),
        ({"model.path": ".", "target_numerics": "pinned"}, "model=hf verifies with transformers'"),
        ({"model.path": ".", "backend.name": "optimized"}, "backend=optimized drafts on CUDA"),
        ({"model.path": ".", "source": "jsonl"}, "source=jsonl reads prompts.path"),
        ({"model.path": ".", "source": "jsonl", "prompts.path": "pyproject.toml", "mode": "teacher_forced"},
         "it runs mode=speculative"),
        ({"model.path": ".", "source": "text", "prompts.path": "no/such/dir"}, "does not exist"),
    ):
        cfg = copy.deepcopy(base)
        for key, value in changes.items():
            OmegaConf.update(cfg, key, value)
        with pytest.raises(ValueError, match=message) as e:
            validate.check_acceptance(cfg)
        assert "\n" not in str(e.value)


def test_a_bad_jsonl_line_is_named(tmp_path):
    from glm_mtp.experiments.settings.prompts import jsonl_prompts

    class Chars:
        def encode(self, text):
            return [ord(c) % 96 for c in text]

    good = json.dumps({"prompt": "ok"})
    for line, rule in (("[1]", "either \"prompt\""), ('{"prompt": ""}', "non-empty text"),
                       ("{oops", "not a JSON object"),
                       ('{"messages": [{"role": "user"}]}', "non-empty list"),
                       ('{"messages": [{"role": "u", "content": "c"}]}', "need a chat template")):
        path = tmp_path / "p.jsonl"
        path.write_text(good + "\n" + line + "\n")
        with pytest.raises(ValueError, match=rule) as e:
            jsonl_prompts(str(path), Chars(), 5)
        assert str(e.value).startswith(f"{path}:2: ")
    path.write_text(good + "\n")
    assert jsonl_prompts(str(path), Chars(), 5) == [Chars().encode("ok")]


def test_transformers_runs_the_shipped_glm5_checkpoint_as_the_package_target():
    """The shipped GLM-5 checkpoint (the package's own target layers, in GLM-5 naming) loaded as
    model=hf: transformers' GlmMoeDsaForCausalLM computes the package target's logits (float32,
    torch's kernels on both sides, so equal up to rounding), and the package's BPE tokenizer and
    held-out split come with it."""
    from glm_mtp.experiments.training.bpe import BpeTokenizer
    from glm_mtp.experiments.targets.checkpoint import load_checkpoint, load_hf_checkpoint, shipped_checkpoint
    from glm_mtp.experiments.targets.target import Target

    path = shipped_checkpoint()
    hf, toy = load_hf_checkpoint(path, "cpu", torch.float32), load_checkpoint(path)
    assert isinstance(hf.tokenizer, BpeTokenizer) and hf.heldout == toy.heldout
    tokens = toy.tokenizer.encode("def main():\n    import sys\n    print(sys.argv[1:])\n")
    package = Target(toy.target, 64)
    want = package.prefill(tokens, package.alloc_state())
    target = HfTarget(hf.hf.model, 4, 64)
    got = target.prefill(tokens, target.alloc_state())
    assert float((got.logits - want.logits).abs().max() / want.logits.abs().max()) < 1e-5
    assert got.logits.argmax(-1).tolist() == want.logits.argmax(-1).tolist()
    assert float((got.hidden - want.hidden).abs().max()) < 1e-4


def test_pinned_topk_sends_ties_to_the_lower_index_inside_the_block_only():
    from glm_mtp.experiments.targets.hf_target import pinned_topk

    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0, 0.0]])
    saved = torch.topk, torch.Tensor.topk
    with pinned_topk("lower_index"):
        assert torch.topk(scores, 3).indices.tolist() == [[1, 3, 0]]
        assert scores.topk(4, dim=-1).indices.tolist() == [[1, 3, 0, 2]]
        assert (-scores).topk(2, largest=False).indices.tolist() == [[1, 3]]
    assert (torch.topk, torch.Tensor.topk) == saved
    with pinned_topk("torch"):
        assert (torch.topk, torch.Tensor.topk) == saved
