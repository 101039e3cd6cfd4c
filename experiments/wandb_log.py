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

    def log_acceptance(self, alphas: list[float], title: str) -> None:
        """Drop the acceptance table."""

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

    def log_acceptance(self, alphas: list[float], title: str) -> None:
        table = self.wandb.Table(columns=["position", "alpha"], data=[[i + 1, a] for i, a in enumerate(alphas)])
        self.run.log({"acceptance_table": table, "acceptance_bar": self.wandb.plot.bar(table, "position", "alpha", title=title)})

    def summary(self, data: dict[str, Any]) -> None:
        for k, v in data.items():
            self.run.summary[k] = v

    def log_image(self, key: str, path: str) -> None:
        self.run.log({key: self.wandb.Image(path)})

    def finish(self) -> None:
        self.run.finish()


def make_logger(cfg: Any, run_dir: str, config: dict[str, Any], job_type: str, name: str | None = None, group: str | None = None) -> NoLogger:
    """The logger the ``logger`` config group chose (``name: wandb`` or ``name: none``)."""
    if cfg.name == "none":
        return NoLogger()
    if cfg.name != "wandb":
        raise ValueError(f"logger.name must be 'wandb' or 'none', got {cfg.name!r}")
    return WandbLogger(cfg.mode, cfg.project, run_dir, config, name=name, job_type=job_type, group=group)
