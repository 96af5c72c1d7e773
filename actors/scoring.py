"""How a finished trajectory is scored: the configured reward's terms, each weighed, timed and
guarded, summed into the trajectory's reward with its components.

A term is a reward on the contract of actors/reward_view.py with a name, a weight and a time
limit. The built-in rewards (actors/rewards.py) are pure and linear in the text: they run on the
event loop. Any other sync reward runs in a daemon thread of its own, so one that blocks holds
neither the loop nor the process's exit (`asyncio.to_thread`'s shared pool would hold both: its
threads are joined at exit, and the local learner steps in that pool too); an async reward runs
on the loop. A term that raises, runs past its limit or gives anything but a finite number (or a
dict of them) scores 0 and is counted (`Scoring.errors`): a broken reward never stops a run.

A remote reward (`RemoteReward`) is one more async term: a POST of the view and the task as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from actors.reward_view import RewardTask, RewardView, dumps
from actors.rewards import REWARDS


class RewardError(Exception):
    """A reward's answer that is not a reward, or a remote reward that could not be had."""


@dataclass(frozen=True)
class Term:
    """One reward of the sum: `weight` times its score."""

    name: str
    """How its score is logged (a dict's keys under `name/` when the sum has several terms)."""
    fn: Callable[[RewardView, RewardTask], Any]
    weight: float = 1.0
    timeout_s: float | None = 60.0
    """Past this the term scores 0 and is counted (None: no limit; a remote reward has its own)."""


@dataclass(frozen=True)
class Scored:
    reward: float
    """The outcome plus the shaping terms: the trajectory's reward before the agent loop's
    own terms (TSPO's latent reward, DAPO's overlong punishment)."""
    outcome: float
    """The configured reward's terms alone (the latent reward is earned by an outcome of 0)."""
    components: dict[str, float]
    """Each term's own score by name, a dict's by its keys; empty for one term's float."""
    errors: int
    """Terms that failed (scored 0) on this trajectory."""


class Scoring:
    """The reward of a trajectory: sum over `terms` of weight x score (the outcome), then the
    `shaping` terms added the same way (actors.format_weight's format bonus)."""

    def __init__(self, terms: Sequence[Term], shaping: Sequence[Term] = ()) -> None:
        names = [t.name for t in (*terms, *shaping)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two rewards are named {twice[0]!r}: give one another name")
        self.terms, self.shaping = tuple(terms), tuple(shaping)
        self._itemized = len(names) > 1
        builtins = tuple(REWARDS.values())
        self._on_the_loop = tuple(
            any(t.fn is f for f in builtins) for t in (*self.terms, *self.shaping)
        )
        self.errors = 0
        """Terms that failed, over every trajectory scored here."""

    @classmethod
    def of(cls, reward: Any = None, format_weight: float = 0.0) -> Scoring:
        """The scoring of the agent settings' `reward`: None for the built-in choice per data
        source (exact match; GAIA's scorer for `gaia*` sources), a built-in's name, a reward
        callable, a `Term` or a sequence of them (what pipeline/ makes of `actors.reward`); plus
        `format_weight` x the format reward as a shaping term."""
        if reward is None:
            reward = "exact_match"
        if isinstance(reward, str):
            if reward not in REWARDS:
                raise ValueError(
                    f"no built-in reward {reward!r}; the built-ins are {', '.join(REWARDS)} "
                    "(plug-ins are resolved from actors.reward by the pipeline)"
                )
            reward = Term(reward, REWARDS[reward], timeout_s=None)
        if isinstance(reward, Term):
            terms: tuple[Term, ...] = (reward,)
        elif callable(reward):
            terms = (Term(getattr(reward, "__name__", "reward"), reward),)
        else:
            terms = tuple(reward)
        shaping = (Term("format", REWARDS["format"], format_weight),) if format_weight > 0 else ()
        return cls(terms, shaping)

    @property
    def names(self) -> list[str]:
        return [t.name for t in (*self.terms, *self.shaping)]

    async def __call__(self, view: RewardView, task: RewardTask) -> Scored:
        everything = (*self.terms, *self.shaping)
        results: list[Any] = []
        waiting: dict[int, Any] = {}
        for i, (term, inline) in enumerate(zip(everything, self._on_the_loop, strict=True)):
            results.append(_scored_here(term, view, task) if inline else None)
            if not inline:
                waiting[i] = self._score(term, view, task)
        if waiting:  # no task is made for a sum of built-ins: they take microseconds
            for i, result in zip(waiting, await asyncio.gather(*waiting.values()), strict=True):
                results[i] = result
        components: dict[str, float] = {}
        values: list[float] = []
        errors = 0
        for term, result in zip(everything, results, strict=True):
            if isinstance(result, RewardFailure):
                errors += 1
                self._failed(term, result.problem)
                values.append(0.0)
                if self._itemized:
                    components[term.name] = 0.0
            elif isinstance(result, dict):
                prefix = f"{term.name}/" if self._itemized else ""
                components.update({prefix + k: v for k, v in result.items()})
                values.append(sum(result.values(), 0.0))
            else:
                values.append(result)
                if self._itemized:
                    components[term.name] = result
        outcome = _weighted_sum(self.terms, values[: len(self.terms)])
        reward = outcome
        for term, value in zip(self.shaping, values[len(self.terms) :], strict=True):
            reward += term.weight * value
        return Scored(reward, outcome, components, errors)

    async def _score(self, term: Term, view: RewardView, task: RewardTask) -> Any:
        """The term's checked score, or a RewardFailure saying what went wrong."""
        limit = asyncio.timeout(term.timeout_s)
        try:
            async with limit:
                if _is_async(term.fn):
                    value = await term.fn(view, task)
                else:
                    value = await _in_thread(term.fn, view, task)
                    if inspect.isawaitable(value):  # a sync callable handing back a coroutine
                        value = await value
            return _checked(value)
        except TimeoutError as exc:
            if limit.expired():
                return RewardFailure(f"ran past its {term.timeout_s:g} s limit")
            return _failure(exc)
        except Exception as exc:  # the reward's own code: anything may fail there
            return _failure(exc)

    def _failed(self, term: Term, problem: str) -> None:
        self.errors += 1
        if math.log10(self.errors).is_integer():  # the 1st, 10th, 100th, ...
            print(
                f"strata: reward {term.name!r} {problem}: scored 0 ({self.errors} failed so far)",
                flush=True,
            )


@dataclass(frozen=True)
class RewardFailure:
    problem: str


def _scored_here(term: Term, view: RewardView, task: RewardTask) -> Any:
    """A built-in's checked score, on the loop (or a RewardFailure)."""
    try:
        return _checked(term.fn(view, task))
    except Exception as exc:  # a row's odd gold answers, say: counted like any failure
        return _failure(exc)


def _failure(exc: Exception) -> RewardFailure:
    if isinstance(exc, RewardError):
        return RewardFailure(str(exc))
    return RewardFailure(f"raised {_first_line(exc)}")


def _weighted_sum(terms: Sequence[Term], values: Sequence[float]) -> float:
    """Sum of weight x value in order, starting from the first (one term of weight 1 is its
    score, exactly)."""
    total = None
    for term, value in zip(terms, values, strict=True):
        part = term.weight * value
        total = part if total is None else total + part
    return 0.0 if total is None else total


def _checked(value: Any) -> float | dict[str, float]:
    """A score as float, or a dict of them; RewardError for anything else."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or not key:
                raise RewardError(f"gave a dict with the key {key!r}: keys must be names")
            out[key] = _number(item, f"gave {{{key!r}: {item!r}}}")
        return out
    return _number(value, f"gave {_short(value)}")


def _number(value: Any, said: str) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, complex):
        number = float(value)
        if math.isfinite(number):
            return number
    raise RewardError(f"{said}, not a finite number or a dict of them")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (an instance with an async __call__)
    )


def _in_thread(fn: Callable, view: RewardView, task: RewardTask) -> asyncio.Future:
    """`fn(view, task)` in a daemon thread of its own; the future the loop awaits. Abandoned
    (timed out) calls run on to their end unobserved."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the wait timed out or was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, error = fn(view, task), None
        except BaseException as exc:  # handed to the loop, which counts it
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed while the reward ran
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="strata-reward", daemon=True).start()
    return future


class RemoteReward:
    """A reward served over HTTP: POST `{"view": ..., "task": ...}` as JSON to `url`; the
    answer is `{"reward": number}` or `{"rewards": {name: number}}`. A request that fails to
    connect, runs past `timeout_s` or gets 429 or 5xx is tried again, up to `retries` times, the
    wait doubling from `backoff_s`; another status or answer fails at once."""

    def __init__(
        self, url: str, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.25
    ) -> None:
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    async def __call__(self, view: RewardView, task: RewardTask) -> float | dict[str, float]:
        body = dumps(view, task)
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return await self._post(body)
            except _Retry as exc:
                last = str(exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if isinstance(exc, TimeoutError):
                    last = f"no answer within {self.timeout_s:g} s"
        raise RewardError(f"{self.url}: {self.retries + 1} attempt(s) failed, the last: {last}")

    async def _post(self, body: bytes) -> float | dict[str, float]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        headers = {"Content-Type": "application/json"}
        # A session per call: a reward is one request per trajectory, and a session is bound
        # to the event loop it was made in (evaluation runs its own).
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(self.url, data=body, headers=headers) as response,
        ):
            if response.status == 429 or response.status >= 500:
                raise _Retry(f"HTTP {response.status}")
            if response.status != 200:
                raise RewardError(f"{self.url} answered HTTP {response.status}")
            try:
                answer = await response.json(content_type=None)
            except ValueError:
                raise RewardError(f"{self.url} answered something that is not JSON") from None
        if isinstance(answer, dict) and set(answer) == {"reward"}:
            return answer["reward"]
        if (
            isinstance(answer, dict)
            and set(answer) == {"rewards"}
            and isinstance(answer["rewards"], dict)
        ):
            return answer["rewards"]
        raise RewardError(
            f'{self.url} answered {_short(answer)}: expected {{"reward": number}} or '
            '{"rewards": {name: number}}'
        )


class _Retry(Exception):
    """A failure worth another try."""
