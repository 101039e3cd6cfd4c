"""Logging for the entry points: W&B (offline by default, files under the run directory) or none.

``logger.mode=online`` is the one override that sends a run to a server. W&B is imported only
when a run asks for it, so importing the package never pulls it in.
"""

from __future__ import annotations

import os
from typing import Any


class NoLogger:
    """Logs nothing; the entry points still write their JSON and PNG files."""

    run_dir: str | None = None

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        """Drop ``data``."""

    def log_acceptance(self, alphas: list[float], title: str, summary: dict[str, Any] | None = None) -> None:
        """Drop the acceptance table."""

    def log_histogram(self, key: str, counts: list[int]) -> None:
        """Drop the histogram."""

    def log_samples(self, samples: list[dict[str, Any]]) -> None:
        """Drop the samples."""

    def summary(self, data: dict[str, Any]) -> None:
        """Drop ``data``."""

    def log_image(self, key: str, path: str) -> None:
        """Drop the image."""

    def finish(self) -> None:
        """Nothing to close."""


class WandbLogger(NoLogger):
    """A W&B run.

    Args:
        mode: ``offline`` (default; no server needed), ``online`` or ``disabled``.
        project: the W&B project.
        run_dir: where the ``wandb/`` folder goes (the Hydra run directory).
        config: the resolved config, logged as the run's config.
        name: the run name; ``job_type`` / ``group``: W&B's grouping fields.
    """

    def __init__(self, mode: str, project: str, run_dir: str, config: dict[str, Any], name: str | None = None,
                 job_type: str | None = None, group: str | None = None) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        os.makedirs(run_dir, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(mode=mode, project=project, dir=run_dir, config=config, name=name, job_type=job_type,
                              group=group, reinit="finish_previous")
        self.run_dir = self.run.dir

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.run.log(data, step=step)

    def log_acceptance(self, alphas: list[float], title: str, summary: dict[str, Any] | None = None) -> None:
        """Per position: alpha and, given the run's ``summary``, its counts, interval and the
        cumulative acceptance."""
        cols, rows = ["position", "alpha"], [[i + 1, a] for i, a in enumerate(alphas)]
        if summary is not None:
            c = summary["counts"]
            cols += ["reached", "accepted", "alpha_low", "alpha_high", "cumulative", "cumulative_low",
                     "cumulative_high"]
            rows = [r + [c["reached"][i], c["accepted"][i], *summary["alpha_ci"][i], summary["cumulative"][i],
                         *summary["cumulative_ci"][i]]
                    for i, r in enumerate(rows)]
        table = self.wandb.Table(columns=cols, data=rows)
        self.run.log({"acceptance_table": table,
                      "acceptance_bar": self.wandb.plot.bar(table, "position", "alpha", title=title)})

    def log_histogram(self, key: str, counts: list[int]) -> None:
        """A histogram of integer values 0..len(counts)-1 (``counts[i]`` occurrences of i)."""
        import numpy as np

        edges = np.arange(len(counts) + 1, dtype=np.float64) - 0.5
        self.run.log({key: self.wandb.Histogram(np_histogram=(list(counts), edges.tolist()))})

    def log_samples(self, samples: list[dict[str, Any]]) -> None:
        """The samples as one table, a row each (columns: the first sample's keys)."""
        if not samples:
            return
        cols = list(samples[0])
        self.run.log({"samples": self.wandb.Table(columns=cols, data=[[str(s.get(c)) for c in cols] for s in samples])})

    def summary(self, data: dict[str, Any]) -> None:
        for k, v in data.items():
            self.run.summary[k] = v

    def log_image(self, key: str, path: str) -> None:
        self.run.log({key: self.wandb.Image(path)})

    def finish(self) -> None:
        self.run.finish()


def make_logger(cfg: Any, run_dir: str, config: dict[str, Any], job_type: str, name: str | None = None,
                group: str | None = None) -> NoLogger:
    """The logger the ``logger`` config group chose (``name: wandb`` or ``name: none``)."""
    if cfg.name == "none":
        return NoLogger()
    if cfg.name != "wandb":
        raise ValueError(f"logger.name must be 'wandb' or 'none', got {cfg.name!r}")
    return WandbLogger(cfg.mode, cfg.project, run_dir, config, name=name, job_type=job_type, group=group)


# ------------------------------------------------------------------------------------------------
# Reading an offline run back. W&B writes an offline run's records to ``run-<id>.wandb``: a
# LevelDB-style log (a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header
# of crc32, length and type FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record`` protobufs.

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
            pending = b""
        else:  # zero padding at the end of a block
            pos += left - 7 - length if left - 7 - length > 0 else 0
    return out


def read_offline_run(run_dir: str, wait_s: float = 30.0) -> dict[str, Any]:
    """``{"config", "summary", "history"}`` of the newest offline W&B run under ``run_dir`` (the
    folder given to ``wandb.init(dir=...)``), decoded from its ``.wandb`` file.

    W&B's service process writes the file on its own schedule: ``finish()`` has been seen to
    return while the file held only its header, or only the first of the summary's records (one
    record per key). Until the run's exit record (written last) is in it, this reads it again, for
    at most ``wait_s`` seconds."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            run = _read_offline_run_once(run_dir)
        except FileNotFoundError:
            raise
        except Exception:  # a record caught half written
            if time.monotonic() > deadline:
                raise
        else:
            finished = run.pop("finished")
            if finished or time.monotonic() > deadline:
                return run
        time.sleep(0.2)


def _read_offline_run_once(run_dir: str) -> dict[str, Any]:
    import glob
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {run_dir}/wandb")
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    finished = False
    key = lambda it: it.key or "/".join(it.nested_key)  # noqa: E731
    for raw in _records(files[-1]):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config.update({key(it): json.loads(it.value_json) for it in rec.run.config.update})
        elif kind == "config":
            config.update({key(it): json.loads(it.value_json) for it in rec.config.update})
        elif kind == "summary":
            summary.update({key(it): json.loads(it.value_json) for it in rec.summary.update})
        elif kind == "history":
            history.append({key(it): json.loads(it.value_json) for it in rec.history.item})
        elif kind == "exit":
            finished = True
    return {"config": config, "summary": summary, "history": history, "finished": finished}
