"""The dataset loader `atlas`: `data.type: atlas` with `data.train_files: [train]` (or `test`)
reads the bundled split of that name wherever Strata runs; any other entry is a path to a file
of the same layout. Rows are mappings, mapped by `data.fields` as a jsonl file's are."""

import json
from collections.abc import Iterator
from pathlib import Path

from strata_example_task.atlas import DATA


def load(path: str) -> Iterator[dict]:
    file = DATA / f"{path}.jsonl" if path in ("train", "test") else Path(path)
    with open(file, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)
