"""Hydra configs of the experiments (package data: the entry points use ``pkg://glm_mtp.conf``)."""
