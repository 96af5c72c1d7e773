"""The window study (docs/results/window.prereg.md, window.md): does stratification help an
agent whose start lies inside the trap bandit's window? `analysis.py` computes the registered
figures from the runs, `render.py` writes them out, `command.py` is
`python -m pipeline.experiments.window`. A study of its own: the reusable harness
(`python -m pipeline.experiment`, its plans, reports and statistics) never imports it."""

from pipeline.experiments.window.command import main

__all__ = ["main"]
