"""Judging a policy and a run: held-out evaluation by source and level, the agent-format rate,
`report.md` with its "did it learn?" section, and the offline replay of a run's trajectories.
"""
