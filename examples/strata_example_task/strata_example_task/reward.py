"""The task's reward: `score(view, task)`, returned as named parts that Strata sums and logs one
by one (metrics.jsonl `reward/correct`, `reward/looked_up`; `reward/atlas/correct` ... when it is
one term of a list)."""

import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _normal(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def score(view, task) -> dict[str, float]:
    """1 for the gold answer, plus 0.1 when the trajectory looked up the row's own table and key
    (the row's `table` and `key` fields, which Strata hands over in `task.extra`)."""
    gold = {_normal(a) for a in task.answers}
    correct = view.answer is not None and _normal(view.answer) in gold
    wanted = (task.extra.get("table"), task.extra.get("key"))
    looked_up = any(
        name == "lookup" and (args.get("table"), args.get("key")) == wanted
        for name, args in view.tool_calls
    )
    return {"correct": float(correct), "looked_up": 0.1 * looked_up}
