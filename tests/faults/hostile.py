"""What the hostile-input properties share (test_hostile_input.py: configs and the CLI;
test_hostile_data.py: question files and trajectory Parquet files): how many examples they try,
and what a good failure looks like."""

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "150"))
"""Fuzzed configs per run of the config property; the data properties, whose examples write
Parquet files, run a third of it."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_DATA = settings(FUZZ, max_examples=max(20, EXAMPLES // 3))

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


def assert_one_line(message: str, *where: str) -> None:
    """One line, naming one of `where` (the file, or the --set that is wrong)."""
    assert message and len(message.splitlines()) == 1 and "\n" not in message, repr(message)
    assert any(w in message for w in where), f"{message!r} names none of {where}"


def escaped(text: str) -> str:
    """`text` as a one-line error shows it (non-printable characters escaped)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
