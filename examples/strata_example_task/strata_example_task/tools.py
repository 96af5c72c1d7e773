"""The lookup tool: a plain function. Strata makes its schema from the signature (two required
strings, a Literal as an enum) and the docstring (the description, each parameter's line), checks
every call's arguments against it, and gives the model what it returns."""

from typing import Literal

from strata_example_task.atlas import atlas


def lookup(table: Literal["capitals", "river_km"], key: str) -> str:
    """Look a key up in one table of the atlas.

    Args:
        table: Which table: capitals (a country's capital) or river_km (a river's length in km).
        key: The country or river, as the question names it (e.g. "Lemru River").
    """
    rows = atlas()[table]
    if key not in rows:
        close = sorted(k for k in rows if k.lower().startswith(key[:3].lower()))[:3]
        hint = f"; close keys: {', '.join(close)}" if close else ""
        return f"No {key!r} in {table}{hint}."
    return str(rows[key])
