"""The run configuration's task options, mixed into :class:`hiso.config.RunConfig`: the built-in
tasks' options live in its ``task_opts`` (:mod:`hiso.tasks.options`), read as ``cfg.task_options``
and, as when they were fields, by their own names (``cfg.dim``: what a user's task reads)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .config_parse import nearest
from .tasks.options import option_fields, options_class


class TaskRules:
    """RunConfig's task options (a mixin placed before pydantic's BaseModel: its ``__getattr__``
    and ``model_copy`` come first)."""

    task: str
    task_opts: dict[str, Any]

    def changed(self, names) -> list[str]:
        """Those of ``names`` whose value is not the field's default (what was set, in effect)."""
        fields = {**type(self).model_fields, **option_fields()}
        return [n for n in names if getattr(self, n) != fields[n].default]

    def __getattr__(self, name: str) -> Any:
        """A task option by its own name (``cfg.dim``), as when it was a field: its value in
        ``task_opts``, else its default (a user's task reads ``cfg.data_dir``, ``cfg.dim``, ...)."""
        fields = option_fields()
        if name in fields:
            opts = self.__dict__.get("task_opts") or {}
            return opts[name] if name in opts else fields[name].default
        return super().__getattr__(name)

    @property
    def task_options(self):
        """The task's options (:mod:`hiso.tasks.options`), its defaults filled: ``cfg.task_options.dim``."""
        from .tasks.registry import task_info
        return options_class(task_info(self.task).options)(**self.task_opts)

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> Any:
        """A copy with ``update``'s values; a task option by its own name (``dim``) goes into ``task_opts``."""
        if update and any(k in option_fields() for k in update):
            mine = {k: v for k, v in update.items() if k in option_fields()}
            update = {**{k: v for k, v in update.items() if k not in mine},
                      "task_opts": {**self.task_opts, **(update.get("task_opts") or {}), **mine}}
        return super().model_copy(update=update, deep=deep)

    def _task_opts_checks(self, info) -> None:
        """``task_opts`` as the task's options class validates them (its defaults filled); one the task
        does not read is dropped (:meth:`_task_option_checks` refused it unless at its default)."""
        fields = option_fields()
        for name in self.task_opts:
            if name not in fields:
                raise ValueError(f"task_opts: {name!r} is not a task option{nearest(name, fields)}")
        read = info.options
        kept = {k: v for k, v in self.task_opts.items() if read is None or k in read}
        try:
            self.task_opts = options_class(read)(**kept).model_dump()
        except ValidationError as e:  # one line, as a RunConfig field's: ``dim: Input should be ...``
            err = e.errors()[0]
            raise ValueError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None

    def _task_option_checks(self, info) -> None:
        """Refuse a task option the task does not read (--lora-r on MNIST, --data-dir on the
        quadratic): such a run would train as if it were unset while config.json said otherwise."""
        if info.options is None:
            return
        from .tasks.registry import TASK_OPTIONS, is_user_task, tasks_reading
        for name in self.changed(sorted(TASK_OPTIONS - info.options)):
            where = tasks_reading(name)
            hint = " (did you mean to give --task?)" if name == "data_dir" and "task" not in self.model_fields_set else ""
            if is_user_task(self.task):
                hint = f" (if it does, add {name!r} to its class's `options`)"
            raise ValueError(f"{name} = {getattr(self, name)!r}: task {self.task} does not use it"
                             f"{' (it is for ' + ', '.join(where) + ')' if where else ''}{hint}")
