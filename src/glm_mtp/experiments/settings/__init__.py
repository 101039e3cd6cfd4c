"""A run's settings before any work: ``validate`` (the checks of the entry points' configs: one
clear line and exit 2, nothing written), ``prompts`` (an acceptance run's prompts by source),
``entry`` (the Hydra entry points' one shape).

May import the constants of ``experiments.loop`` and ``experiments.targets`` it checks against;
Hydra only inside ``entry``'s functions.
"""
