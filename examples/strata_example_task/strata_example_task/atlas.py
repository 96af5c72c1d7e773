"""The bundled atlas (data/atlas.json): fictional countries' capitals and rivers' lengths, so
a model can only know them by looking them up."""

import json
from functools import cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


@cache
def atlas() -> dict[str, dict[str, object]]:
    """table -> key -> value."""
    return json.loads((DATA / "atlas.json").read_text(encoding="utf-8"))


def km_to_miles(km: float) -> int:
    """The conversion the questions' answers use, rounded to a whole mile."""
    return round(km * 0.621371)
