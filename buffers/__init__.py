"""Data plane: trajectory records, the group-by-prompt buffer, Parquet spill and replay."""
