"""The built-in tasks' own options, in typed groups: a task's options are the fields it reads.

A run records them in ``RunConfig.task_opts`` (config.json's ``task_opts``) and reads them as
``cfg.task_options`` (the task's options object, defaults filled); each field is also a flag
(``--dim``) and a flat TOML key (``dim = 500``), as before they moved out of RunConfig.
"""

from __future__ import annotations

from functools import cache

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo


class TaskOptions(BaseModel):
    """A group of task options (a pydantic model: bounds and descriptions are its fields')."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class QuadraticOptions(TaskOptions):
    """The quadratic task's problem."""

    dim: int = Field(1000, gt=0, description="quadratic: dimension d")
    sigma: float = Field(1.0, ge=0, description="quadratic: spread of log curvatures (0: isotropic)")
    heterogeneity: float = Field(1.0, ge=0, description=(
        "quadratic: spread of the clients' optima around the common centre"))
    noise: float = Field(0.0, ge=0, description="quadratic: gradient noise scale (0: deterministic)")


class ColumnOptions(TaskOptions):
    """Which columns of your own files the text and instruct tasks read."""

    text_column: str = Field("text", min_length=1, description="text task: the column of the text to classify")
    label_column: str = Field("label", min_length=1, description="text task: the column of the label")
    prompt_column: str = Field("prompt", min_length=1, description="instruct task: the column of the prompt")
    response_column: str = Field("response", min_length=1, description="instruct task: the reference answer's column")


# the groups in --help's order, each with the run option its flags sit before (None: at the end)
GROUPS: tuple[tuple[type[TaskOptions], str | None], ...] = ((QuadraticOptions, "data_dir"), (ColumnOptions, None))


@cache
def option_fields() -> dict[str, FieldInfo]:
    """Every moved task option by name (the groups' fields, in --help's order)."""
    return {name: f for cls, _ in GROUPS for name, f in cls.model_fields.items()}


def defaults() -> dict:
    """Each task option's default."""
    return {name: f.default for name, f in option_fields().items()}


@cache
def options_class(names: frozenset[str] | None) -> type[TaskOptions]:
    """The options class of a task reading ``names`` (None: every task option, a user's task): the
    groups' fields among them, one pydantic model."""
    fields = option_fields()
    chosen = fields if names is None else {n: f for n, f in fields.items() if n in names}
    for cls, _ in GROUPS:  # a task reading a whole group: that group's class
        if set(chosen) == set(cls.model_fields):
            return cls
    return create_model("TaskOptionsOf", __base__=TaskOptions,
                        **{n: (f.annotation, f) for n, f in chosen.items()})
