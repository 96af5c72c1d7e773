"""Experiments: a plan of variants x seeds run as `pipeline.launch` runs, read back, tested
(Welch, bootstrap) and written up with plots as a results document.
"""
