"""Outcome rewards of a finished trajectory: answer extraction, EM / F1 / GAIA scoring, format.

EM and F1 follow Search-R1 (SQuAD normalisation); `gaia_score` follows the logic of the GAIA
benchmark's official scorer, so minigaia and GAIA numbers are comparable with published ones.
Everything here is linear in the text length: responses can be long and full of garbage.

`REWARDS` holds the built-in rewards on the plug-in contract (`score(view, task)`,
actors/reward_view.py), by the names `actors.reward` gives them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable

from actors.reward_view import RewardTask, RewardView

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_AGENT_TAG = re.compile(r"<(/?)(search|python|think|answer)>")
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)
KINDS = ("exact_match", "f1", "gaia")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, golden_answers: list[str] | str) -> float:
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(g) for g in _as_list(golden_answers)))


def answer_appears(text: str, golden_answers: list[str] | str) -> bool:
    """Whether a gold answer appears in `text` (a tool observation): both normalised as exact
    match normalises, the answer a whole-word span of the text (TSPO's matching rule, as read here)."""
    padded = f" {normalize_answer(text)} "
    return any(
        normalized and f" {normalized} " in padded
        for normalized in (normalize_answer(g) for g in _as_list(golden_answers))
    )


ANSWER_MATCHERS = {"exact_match_span": answer_appears}
"""`actors.latent_match` -> whether a gold answer appears in an observation."""


def f1(prediction: str, golden_answers: list[str] | str) -> float:
    """Best SQuAD token F1 over the golden answers (1.0 when both sides normalise to nothing)."""
    predicted = normalize_answer(prediction).split()
    return max(
        (_token_f1(predicted, normalize_answer(g).split()) for g in _as_list(golden_answers)),
        default=0.0,
    )


def _token_f1(predicted: list[str], golden: list[str]) -> float:
    if not predicted or not golden:
        return float(predicted == golden)
    same = sum((Counter(predicted) & Counter(golden)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(golden)
    return 2 * precision * recall / (precision + recall)


def gaia_score(prediction: str, truth: str) -> bool:
    """GAIA's question_scorer: numbers as floats, `,`/`;` lists element-wise, else loose strings."""
    if _is_number(truth):
        return _as_number(prediction) == float(truth)
    if "," in truth or ";" in truth:
        truths, predictions = re.split(r"[,;]", truth), re.split(r"[,;]", prediction)
        return len(truths) == len(predictions) and all(
            _as_number(p) == float(t) if _is_number(t) else _squash(p, False) == _squash(t, False)
            for p, t in zip(predictions, truths, strict=True)
        )
    return _squash(prediction, True) == _squash(truth, True)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _as_number(s: str) -> float | None:
    """The prediction as a number once `$`, `%` and `,` are gone; None if it is not one."""
    cleaned = s.replace("$", "").replace("%", "").replace(",", "")
    return float(cleaned) if _is_number(cleaned) else None


def _squash(s: str, drop_punctuation: bool) -> str:
    s = "".join(s.split()).lower()
    return s.translate(_NO_PUNCTUATION) if drop_punctuation else s


def extract_answer(text: str) -> str | None:
    """The stripped content of the last complete <answer>…</answer>, or None.

    An unclosed trailing <answer> does not count (the last complete one before it does); with
    nested tags the innermost answer wins: `<answer><answer>x</answer></answer>` gives "x".
    Only str.find/rfind over the text, so a megabyte of garbage costs milliseconds.
    """
    last_close = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, last_close) if last_close >= 0 else -1
    if start < 0:
        return None
    start += len("<answer>")
    return text[start : text.find("</answer>", start)].strip()


def format_reward(text: str) -> float:
    """1.0 when every search/python/think/answer tag is closed and un-nested and the text ends
    with its one and only <answer> block (trailing whitespace aside), else 0.0."""
    open_tag, answers, answer_end = None, 0, 0
    for tag in _AGENT_TAG.finditer(text):
        name = tag.group(2)
        if not tag.group(1):
            if open_tag is not None:  # nested
                return 0.0
            open_tag = name
        elif name != open_tag:  # closes what is not open
            return 0.0
        else:
            open_tag = None
            if name == "answer":
                answers, answer_end = answers + 1, tag.end()
    well_formed = open_tag is None and answers == 1 and not text[answer_end:].strip()
    return float(well_formed)


def reward_for(data_source: str, kind: str | None = None) -> Callable[[str, list[str]], float]:
    """The outcome scorer of a data source: GAIA's scorer for `gaia*` sources (whatever `kind`
    says: their truths are written for it), else `kind`, exact match by default."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown reward kind {kind!r}: expected one of {', '.join(KINDS)}")
    if data_source.lower().startswith("gaia") or kind == "gaia":
        return _gaia_reward
    return f1 if kind == "f1" else exact_match


def _gaia_reward(prediction: str, golden_answers: list[str] | str) -> float:
    golden = _as_list(golden_answers)
    return float(bool(golden) and gaia_score(prediction, golden[0]))


def score(
    response_text: str,
    golden_answers: list[str],
    data_source: str,
    kind: str | None = None,
    format_weight: float = 0.0,
) -> float:
    """Outcome reward of a response (0 without an answer), plus `format_weight` × format reward."""
    scorer = reward_for(data_source, kind)
    answer = extract_answer(response_text)
    reward = 0.0 if answer is None else scorer(answer, golden_answers)
    if format_weight > 0:
        reward += format_weight * format_reward(response_text)
    return reward


def _as_list(golden_answers: list[str] | str) -> list[str]:
    return [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)


# --------------------------------------------------------- the built-in rewards, on the contract


def exact_match_reward(view: RewardView, task: RewardTask) -> float:
    """1 when the final answer matches a gold answer after SQuAD normalisation, else 0 (and 0
    without an answer); a `gaia*` source is scored by GAIA's scorer (its truths are written
    for it). What `actors.reward` unset gives."""
    return _outcome(view, task, "exact_match")


def f1_reward(view: RewardView, task: RewardTask) -> float:
    """The final answer's best SQuAD token F1 over the gold answers (0 without an answer); a
    `gaia*` source is scored by GAIA's scorer."""
    return _outcome(view, task, "f1")


def gaia_reward(view: RewardView, task: RewardTask) -> float:
    """GAIA's scorer against the first gold answer (0 without an answer)."""
    return _outcome(view, task, "gaia")


def format_score(view: RewardView, task: RewardTask) -> float:
    """1 for a well-formed response (`format_reward`), else 0; `actors.format_weight` adds it."""
    return format_reward(view.response)


def _outcome(view: RewardView, task: RewardTask, kind: str) -> float:
    if view.answer is None:
        return 0.0
    return reward_for(task.data_source, kind)(view.answer, list(task.answers))


REWARDS = {
    "exact_match": exact_match_reward,
    "f1": f1_reward,
    "gaia": gaia_reward,
    "format": format_score,
}
"""The built-in rewards by name. Each is pure and linear in the text length, so the agent loop
scores them on its event loop; any other reward runs in a thread of its own."""
