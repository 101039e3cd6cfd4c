"""No setting accepted and then ignored (issue 49 item 3), walked over every entry point's keys.

Each Hydra command (acceptance, record, stop_sweep, train, grid, finetune) runs once, at tiny
sizes and in process, on a config whose reads are traced (every ``DictConfig`` lookup on it,
and every subtree it converts to a container); the checks run before the tracing starts, so a
key the check reads and the run then drops counts as unread. Every leaf of the composed config
must then be read by the run (honoured; most are also recorded in what it writes), be one of
Hydra's own (``task_name`` names the run folder), or be refused by the command's check when
given another value (``ALTERNATIVES``), in one line naming it. A key the walk finds neither
read nor listed fails the test: a new key gets a reader or a refusal. The argparse commands
(bench, bench_batch, grid_report, costs) are walked the same way over their flags, the parsed
namespace traced. W&B is replaced by a logger that only takes its arguments (the keys are read
as a real run reads them, nothing started).
"""

import argparse
import contextlib
import json
import random
import shutil

import pytest
from omegaconf import DictConfig, OmegaConf

from glm_mtp.experiments import acceptance, bench, bench_batch, costs, grid, grid_report, record, stop_sweep, train
from glm_mtp.experiments.reporting import wandb_log
from glm_mtp.experiments.settings.explicit import compose_config
from glm_mtp.experiments.settings.validate import check_acceptance_run, check_grid, check_train

HYDRA_KEYS = {"task_name"}  # read by Hydra itself: outputs/<task_name>/<time>


def leaves(node, prefix=""):
    """The dotted leaf keys of a plain mapping (a list is a leaf)."""
    out = []
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out += leaves(value, name) if isinstance(value, dict) and value else [name]
    return out


class Reads(set):
    """The full keys a run read; ``overwritten``: those it set before reading them (the given
    value dropped: such a key counts as unread)."""

    def __init__(self):
        super().__init__()
        self.overwritten = set()


@contextlib.contextmanager
def traced_reads(root, seen):
    """Record into ``seen`` (a ``Reads``) the full key of every lookup on ``root``'s nodes
    (attribute, item, ``get``), and every leaf under a subtree of it converted by
    ``OmegaConf.to_container`` (the root's own conversion, a logger's record of the whole config,
    reads nothing); a key set (attribute or item) before it was read goes to ``overwritten``."""
    get_impl, to_container = DictConfig._get_impl, OmegaConf.to_container
    set_attr, set_item = DictConfig.__setattr__, DictConfig.__setitem__

    def ours(node):
        try:
            return node._get_root() is root
        except Exception:
            return False

    def traced_get(self, key, default_value, validate_key=True):
        if ours(self):
            with contextlib.suppress(Exception):
                seen.add(self._get_full_key(key))
        return get_impl(self, key, default_value, validate_key)

    def traced_to_container(cfg, *args, **kwargs):
        if isinstance(cfg, DictConfig) and cfg is not root and ours(cfg):
            base = cfg._get_full_key(None)
            seen.update(f"{base}.{k}" for k in leaves(to_container(cfg, resolve=False)))
        return to_container(cfg, *args, **kwargs)

    def setter(original):
        def traced_set(self, key, value):
            if ours(self):
                with contextlib.suppress(Exception):
                    full = self._get_full_key(key)
                    if full not in seen:
                        seen.overwritten.add(full)
            return original(self, key, value)

        return traced_set

    DictConfig._get_impl = traced_get
    OmegaConf.to_container = traced_to_container
    DictConfig.__setattr__, DictConfig.__setitem__ = setter(set_attr), setter(set_item)
    try:
        yield seen
    finally:
        DictConfig._get_impl, OmegaConf.to_container = get_impl, to_container
        DictConfig.__setattr__, DictConfig.__setitem__ = set_attr, set_item


class TakesArguments(wandb_log.NoLogger):
    """W&B's place in the walk: takes the arguments a run passes (so the logger's keys are read
    as they are), logs nothing."""

    def __init__(self, mode, project, run_dir, config, name=None, job_type=None, group=None):
        self.args = (mode, project, name, job_type, group)


@pytest.fixture(autouse=True)
def no_wandb(monkeypatch):
    monkeypatch.setattr(wandb_log, "WandbLogger", TakesArguments)


TINY = ["model=tiny_random", "run.num_prompts=2", "run.prompt_tokens=8", "run.max_new_tokens=4", "logger=wandb"]
TRAIN = ["train.base=shipped", "tokenizer.limit_items=4", "train.steps=2", "train.batch_size=2", "train.seq_len=16",
         "train.eval_every=10", "train.eval_windows=1", "train.log_every=1", "train.warmup=1", "logger=wandb"]
SWEEP = ["num_drafts=2", "sweep.thresholds.prob=[0.5]", "sweep.thresholds.cumprob=[0.5]",
         "sweep.thresholds.margin=[1.0]", "speedup.costs=glm5"]
GRID_EVAL = ["eval.common=[" + ",".join(f"'{o}'" for o in (
    "model=shipped", "logger=none", "num_drafts=2", "run.num_prompts=1", "run.prompt_tokens=8", "run.max_new_tokens=3",
    "speedup.costs=glm5")) + "]", "eval.feed_prompts=1"]


def finetune_inputs(root, logger="wandb"):
    """A tiny checkpoint and a synthetic trace of it (tests/experiments/test_finetune.py's)."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("ft", os.path.join(os.path.dirname(__file__), "test_finetune.py"))
    ft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ft)
    w = ft._checkpoint(str(root / "ck"), "glm5next_tiny")
    ft._trace(str(root / "tr"), str(root / "ck"), w.config.vocab_size, w.config.hidden_size)
    return [f"model.path={root / 'ck'}", "model=shipped", f"trace.path={root / 'tr'}", "finetune.steps=2",
            "finetune.eval_every=2", "finetune.batch_size=2", f"logger={logger}"]


def fake_train_run(cfg, run_dir, command=""):
    """grid's training step in the walk: the shipped checkpoint as the trained head (train's keys
    are walked by train's own run)."""
    from glm_mtp.experiments.targets.checkpoint import shipped_checkpoint

    shutil.copytree(shipped_checkpoint(), cfg.out)
    return {"steps": 0, "target_loss": 0.0}


def commands(root):
    """name -> (config, overrides, check, run(cfg, folder))."""
    from glm_mtp.experiments.training.finetune_checks import check_finetune
    from glm_mtp.experiments.training.finetune_run import run as finetune_run

    return {
        "acceptance": ("config", [*TINY, "speedup.costs=glm5"], check_acceptance_run,
                       lambda cfg, d: acceptance.run(cfg, str(d))),
        "record": ("config", [*TINY, f"trace.out={root / 'trace'}", "trace.max_drafts=2", "trace.cost_repeats=1"],
                   record.check_record, lambda cfg, d: record.record(cfg, str(d))),
        "stop_sweep": ("stop_sweep", [*TINY, *SWEEP], stop_sweep.check_sweep,
                       lambda cfg, d: stop_sweep.run(cfg, str(d))),
        "train": ("train", [*TRAIN, f"out={root / 'trained'}"], check_train, lambda cfg, d: train.run(cfg, str(d))),
        "grid": ("grid", [*TRAIN, *GRID_EVAL], check_grid, lambda cfg, d: grid.run(cfg, str(d))),
        "finetune": ("finetune", [*finetune_inputs(root), f"finetune.out={root / 'tuned'}"], check_finetune,
                     lambda cfg, d: finetune_run(cfg, str(d), check_finetune(cfg), "walk")),
    }


# Given another value than its config's, each key a run did not read must be refused by the
# check naming it: the overrides that give it one (valid on their own where the key has rules).
ALTERNATIVES = {
    "attention": ["attention=dense"], "backend.name": ["backend=optimized"], "batch_size": ["batch_size=2"],
    "draft": ["draft=sampled"], "feed_hidden": ["feed_hidden=pre_norm"], "num_drafts": ["num_drafts=4"],
    "policy": ["policy=refeed"], "verify": ["verify=match"], "run.check_lossless": ["run.check_lossless=true"],
    "run.name": ["run.name=other"], "speedup.costs": ["speedup.costs=bytes:glm5"],
    "speedup.repeats": ["speedup.repeats=3"], "stop.rule": ["stop.rule=prob", "stop.threshold=0.5"],
    "stop.threshold": ["stop.threshold=0.5"], "grammar.drafts": ["grammar.drafts=unmasked"],
    "grammar.kind": ["grammar=regex", "grammar.pattern=a+"], "grammar.path": ["grammar.path=g.regex"],
    "grammar.pattern": ["grammar.pattern=a+"], "trace.path": ["trace.path=elsewhere"],
    "trace.out": ["trace.out=elsewhere"], "trace.max_drafts": ["trace.max_drafts=3"],
    "trace.batch_size": ["trace.batch_size=3"], "trace.cost_repeats": ["trace.cost_repeats=2"],
    "tokenizer.sample_every": ["tokenizer.sample_every=2"], "tokenizer.vocab_size": ["tokenizer.vocab_size=1024"],
    "out": ["out=elsewhere"],
}


# Keys a config group sets: a refusal names them by the group (``grammar=regex``, ``backend=...``).
GROUP_KEYS = {"grammar.kind": "grammar=", "backend.name": "backend=", "logger.name": "logger="}


def named(key):
    """How a one-line refusal may name ``key``: its last part, or its config group."""
    return [key.split(".")[-1], *([GROUP_KEYS[key]] if key in GROUP_KEYS else [])]


def alternative(key, value):
    """The overrides giving ``key`` another value: ``ALTERNATIVES``, or for an ``arch.*`` number
    one more than ``value`` (a bool negated)."""
    if key in ALTERNATIVES:
        return ALTERNATIVES[key]
    if key.startswith("arch.") and isinstance(value, (bool, int, float)):
        return [f"{key}={json.dumps(not value if isinstance(value, bool) else value + 1)}"]
    return None


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """Per command: its config's leaves, the keys its run read, its overrides and check."""
    root = tmp_path_factory.mktemp("walk")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wandb_log, "WandbLogger", TakesArguments)
        for name, (config, overrides, check, run) in commands(root).items():
            cfg = compose_config(config, overrides)
            check(cfg)
            seen = Reads()
            patch = pytest.MonkeyPatch()
            if name == "grid":
                patch.setattr(train, "run", fake_train_run)
            try:
                with traced_reads(cfg, seen):
                    run(cfg, root / f"run-{name}")
            finally:
                patch.undo()
            out[name] = (leaves(OmegaConf.to_container(cfg, resolve=False)), seen, config, overrides, check)
    return out


def train_keys():
    return set(leaves(OmegaConf.to_container(compose_config("train", []), resolve=False)))


COMMANDS = ["acceptance", "record", "stop_sweep", "train", "grid", "finetune"]
DRAWN = 3  # refusals checked per command in the default run (the slow walk checks every one)


def unread_keys(walked, name):
    """``name``'s keys its run did not read (Hydra's own aside; grid's training keys are train's)."""
    keys, seen, *_ = walked[name]
    unread = [k for k in keys if (k not in seen or k in seen.overwritten) and k not in HYDRA_KEYS]
    if name == "grid":  # its training's keys go to train.run, walked as train's
        trains = train_keys()
        unread = [k for k in unread if k not in trains or k in walked[name][1].overwritten]
    return unread


def check_refused(walked, name, keys, tmp_path):
    """Each of ``keys``, given its alternative, is refused by ``name``'s check in one line naming it."""
    _, _, config, overrides, check = walked[name]
    (tmp_path / "g.regex").write_text("[a-z]+\n")
    plain = OmegaConf.to_container(compose_config(config, overrides), resolve=False)
    # the walk's run wrote its outputs: each refusal's config names new ones
    fresh = {"trace.out", "out", "finetune.out"}
    overrides = [o if o.split("=")[0] not in fresh else f"{o.split('=')[0]}={tmp_path / 'new'}" for o in overrides]
    for key in keys:
        value = plain
        for part in key.split("."):
            value = value[part]
        given = alternative(key, value)
        cfg = compose_config(config, [*overrides, *[g.replace("g.regex", str(tmp_path / "g.regex")) for g in given]])
        assert OmegaConf.select(cfg, key) != value, (name, key, "the alternative is the walked value")
        try:
            check(cfg)
        except ValueError as e:
            message = str(e)
        else:
            pytest.fail(f"{name}: {key} given ({' '.join(given)}) is neither read by the run nor refused")
        assert "\n" not in message and any(n in message for n in named(key)), (name, key, message)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_key_is_read_or_refused(walked, name, tmp_path):
    """Every key the run did not read has a known refusal; a seeded draw of them is refused."""
    _, _, config, overrides, _ = walked[name]
    unread = unread_keys(walked, name)
    composed = compose_config(config, overrides)
    for key in unread:
        assert alternative(key, OmegaConf.select(composed, key)) is not None, \
            f"{name}: {key} is neither read by the run nor known to be refused"
    rng = random.Random(f"issue 49 {name}")
    check_refused(walked, name, rng.sample(unread, min(DRAWN, len(unread))), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", COMMANDS)
def test_every_unread_key_is_refused(walked, name, tmp_path):
    check_refused(walked, name, unread_keys(walked, name), tmp_path)


def test_named_cases(walked):
    """record ran with logger=wandb and read every logger key (it logs); the grid overwrites out
    (each job's checkpoint goes into its run folder), so out counts as unread and is refused; a
    live acceptance run reads none of the recording's keys."""
    _, seen, *_ = walked["record"]
    assert {"logger.name", "logger.mode", "logger.project", "run.name"} <= seen
    assert "out" in unread_keys(walked, "grid")
    assert set(unread_keys(walked, "acceptance")) == {"trace.out", "trace.max_drafts", "trace.batch_size",
                                                      "trace.cost_repeats"}


def test_the_walk_catches_a_key_let_through(walked, tmp_path, monkeypatch):
    """A broken variant: record without its rule for trace.batch_size would drop the key; the walk
    says so, naming it."""
    monkeypatch.setattr(record, "check_record_reads", lambda cfg: None)
    with pytest.raises(pytest.fail.Exception, match="record: trace.batch_size given"):
        check_refused(walked, "record", ["trace.batch_size"], tmp_path)


class TracedNamespace(argparse.Namespace):
    """A parsed namespace that records into its class's ``seen`` the attributes read from it."""

    seen: set = set()

    def __getattribute__(self, name):
        if not name.startswith("_"):
            type(self).seen.add(name)
        return object.__getattribute__(self, name)


def traced_parse(monkeypatch, seen):
    """``argparse.ArgumentParser.parse_args`` returning a ``TracedNamespace`` whose reads start
    once parsing (and the parser's own checks in the caller) is done: the caller reads after."""
    parse = argparse.ArgumentParser.parse_args

    traced = type("Traced", (TracedNamespace,), {"seen": seen})

    def parse_traced(self, args=None, namespace=None):
        return traced(**vars(parse(self, args, namespace)))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_traced)


def dests(parser):
    return {a.dest for a in parser._actions if a.dest != "help"}


def traced_config(cls, seen):
    """A subclass of the dataclass ``cls`` whose instances record into ``seen`` the fields read."""

    def getattribute(self, name):
        if not name.startswith("_"):
            seen.add(name)
        return object.__getattribute__(self, name)

    return type(f"Traced{cls.__name__}", (cls,), {"__getattribute__": getattribute})


def test_bench_reads_every_flag_or_refuses_it(tmp_path, monkeypatch):
    """Each BenchConfig field is read by the mode it runs in, or refused by parse_args naming
    the flag; the propose bench and --target-costs walked (tiny sizes)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(bench.BenchConfig)}
    assert fields == dests(bench.bench_parser())
    modes = {"bench": ["--presets", "tiny", "--backends", "reference", "--drafts", "1", "--repeats", "1",
                       "--warmup", "0", "--copy-mib", "1", "--counters", "--context", "8", "--max-seq-len", "32"],
             "target costs": ["--target-costs", "--backends", "reference", "--drafts", "1", "--repeats", "1",
                              "--context", "8", "--max-seq-len", "32"]}
    others = {"presets": ["--presets", "small"], "dtype": ["--dtype", "float16"], "max_position_embeddings":
              ["--max-position-embeddings", "64"], "warmup": ["--warmup", "1"], "copy_mib": ["--copy-mib", "2"],
              "counters": ["--counters", "tiny"], "checkpoint": ["--checkpoint", "ck"], "device": ["--device", "cuda"]}
    for mode, argv in modes.items():
        bc = bench.parse_args([*argv, "--out", str(tmp_path / mode)])
        seen = set()
        tb = traced_config(bench.BenchConfig, seen)(**dataclasses.asdict(bc))
        monkeypatch.setattr(bench, "copy_bandwidth", lambda device, nbytes: 1e9)
        (bench.run_target_costs if bc.target_costs else bench.run)(tb)
        for name in fields - seen - {"target_costs"}:  # the mode, read by main
            assert name in others, f"bench ({mode}): {name} is neither read nor known to be refused"
            with pytest.raises(SystemExit) as e:
                bench.parse_args([*argv, *others[name], "--out", str(tmp_path / "refused")])
            assert e.value.code == 2, (mode, name)


def test_bench_batch_reads_every_flag(tmp_path, monkeypatch):
    seen = set()
    traced_parse(monkeypatch, seen)
    a = bench_batch.parse_args(["--preset", "tiny", "--batch-sizes", "1", "2", "--repeats", "1", "--warmup", "0",
                                "--no-counters", "--context", "8", "--max-seq-len", "32", "--out",
                                str(tmp_path / "bb")])
    seen.clear()
    bench_batch.run(a)
    parser_dests = {"preset", "batch_sizes", "drafts", "device", "dtype", "context", "max_seq_len", "repeats",
                    "warmup", "seed", "counters", "out"}
    assert set(vars(a)) == parser_dests
    assert parser_dests <= seen, parser_dests - seen


def test_grid_report_refuses_the_other_modes_flags(tmp_path, capsys):
    for argv, flag in ((["--feeds", "shipped", "--out", str(tmp_path)], "--out"),
                       (["--feeds", "shipped", "--partial"], "--partial"),
                       (["--feeds", "shipped", str(tmp_path)], "grid_dir"),
                       ([str(tmp_path), "--prompts", "3"], "--prompts"),
                       ([str(tmp_path), "--num-drafts", "2"], "--num-drafts")):
        with pytest.raises(SystemExit) as e:
            grid_report.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and flag in err[-1], (argv, err)
    assert not list(tmp_path.iterdir())


def test_costs_reads_its_one_argument(monkeypatch, capsys):
    seen = set()
    traced_parse(monkeypatch, seen)
    assert costs.main(["show", "glm52-h200x8-mstar"]) == 0
    assert {"command", "name"} <= seen
