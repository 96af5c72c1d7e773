"""Experiments, in three parts.

The harness, for any experiment: `plan.py` and `run.py` (`python -m pipeline.experiment`: the
variants x seeds of an experiment file, each a `pipeline.launch` run), `data.py`, `findings.py`,
`plots.py` and `report.py` (`python -m pipeline.experiment_report`: the runs read back, tested
and written up), and the statistics they test with, `stats.py` and `proportions.py`.

The trap and the diagnostic built on it: `searches.py` (two-hop trajectories by their searches,
and the within-question gap, the one estimator of whether chaining pays), `start.py`
(`python -m pipeline.start`), `trap.py`, `trap_exact.py`, `trap_tables.py` (the trap bandit,
`python -m pipeline.trap`), `hop_speed.py` and `diagnose.py` (`python -m pipeline.diagnose`).

Studies, each a package of its own that nothing above imports: `window/` (the window study,
docs/results/window.md).
"""
