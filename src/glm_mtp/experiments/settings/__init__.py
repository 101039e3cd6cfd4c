"""A run's settings before any work: ``validate`` (the checks of the entry points' configs: one
clear line and exit 2, nothing written), ``prompts`` (an acceptance run's prompts by source),
``windows`` (the token windows and prompts cut from a source), ``model`` (the run's drafter and
target from its ``model`` group), ``entry`` (the Hydra entry points' one shape).

May import the constants of ``experiments.loop`` it checks against, ``experiments.targets`` (the
models ``model`` loads) and ``experiments.training``'s corpus inside ``windows``' functions;
Hydra only inside ``entry``'s functions.
"""
