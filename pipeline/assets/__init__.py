"""What a run needs on disk before it starts, built once and cached: the synthetic mini-GAIA
world (questions, passages, demonstrations), question files, the tiny policy and its warm start.
"""
