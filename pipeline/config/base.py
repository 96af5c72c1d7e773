"""What every config section shares: frozen pydantic models that refuse unknown keys, and backend
unions discriminated on `type` (see `pipeline.config.schema`)."""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel = 60, 60, 1


def shown(value: object) -> str:
    """`value` as Python writes it, cut short for an error line: YAML aliases nest a billion
    elements in a few lines, and a long string or list would make a huge line."""
    try:
        return _SHORT.repr(value)
    except ValueError:  # an integer past Python's 4300-digit str() limit
        return "a number of over 4300 digits"


def _tag_or(default: str) -> Discriminator:
    """Discriminate a backend union on `type`, taking `default` when the YAML leaves it out."""

    def pick(value: object) -> str | None:
        if isinstance(value, dict):
            tag = value.get("type", default)
            return tag if isinstance(tag, str) else shown(tag)  # pydantic would str() it whole
        return getattr(value, "type", None)

    return Discriminator(pick)


def backend_union(classes: tuple[type[Section], ...]) -> Any:
    """A section that is one of `classes`, chosen by its `type` key; the first when the YAML
    leaves `type` out. Each class's `type` field defaults to its own tag."""
    tags = [c.model_fields["type"].default for c in classes]
    members = tuple(Annotated[c, Tag(t)] for c, t in zip(classes, tags, strict=True))
    return Annotated[Union[members], _tag_or(tags[0])]  # noqa: UP007 (a tuple of members)
