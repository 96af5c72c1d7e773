"""The configuration schema: one frozen pydantic model per section, the YAML loader with `--set`
overrides and one-line errors, and the generated reference (`docs/config.md`). Nothing here
touches the disk at import or imports torch: `--dry-run` validates a config in well under a second.
"""
