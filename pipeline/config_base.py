"""What every config section shares: frozen pydantic models that refuse unknown keys, and backend
unions discriminated on `type` (see `pipeline.config`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Discriminator


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


def _tag_or(default: str) -> Discriminator:
    """Discriminate a backend union on `type`, taking `default` when the YAML leaves it out."""

    def pick(value: object) -> str | None:
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", None)

    return Discriminator(pick)
