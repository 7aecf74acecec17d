"""Strict pydantic models: the base of every config section (:mod:`pflkit.config`) and of every
algorithm's ``Params`` (:mod:`pflkit.algorithms.base`). It imports no other pflkit module."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


class StrictNumbers(BaseModel):
    """Unknown keys, inf/nan and true/false for a number are refused (config sections and
    algorithm parameters)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: Any) -> Any:
        field = cls.model_fields.get(info.field_name)
        if isinstance(v, bool) and field is not None and bool_is_wrong(field.annotation):
            raise ValueError("must be a number, not true/false")
        return v


def bool_is_wrong(annotation: Any) -> bool:
    """Whether a field of this type takes numbers but not booleans (pydantic would read true
    as 1)."""
    args = typing.get_args(annotation) or (annotation,)
    return bool not in args and any(a in (int, float) for a in args)
