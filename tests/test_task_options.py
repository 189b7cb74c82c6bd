"""The built-in tasks own their options (hiso.tasks.options): task_opts, cfg.task_options, the
flags and flat TOML keys that reach them, and older configurations read as before."""

import json

import pytest

from cli_helpers import run_cli
from hiso import compat
from hiso.config import ConfigError, RunConfig, load_config
from hiso.runners.runmodel import config_sha256
from hiso.tasks.options import QuadraticOptions, defaults, option_fields


def test_a_task_option_lives_in_task_opts_and_reads_by_its_own_name_too():
    cfg = RunConfig(dim=50, sigma=2)
    assert not set(option_fields()) & set(RunConfig.model_fields)
    assert cfg.task_opts == {"dim": 50, "sigma": 2.0, "heterogeneity": 1.0, "noise": 0.0}
    assert isinstance(cfg.task_options, QuadraticOptions) and cfg.task_options.dim == 50
    assert cfg.dim == 50 and cfg.text_column == "text"  # a user's task reads cfg.<option>
    assert cfg.model_copy(update={"dim": 7}).task_options.dim == 7
    assert RunConfig(**{**cfg.model_dump(), "dim": 9}).dim == 9  # by its name, over task_opts


def test_toml_keys_flat_or_in_a_table_and_flags_over_them(tmp_path):
    flat, table = tmp_path / "flat.toml", tmp_path / "table.toml"
    flat.write_text("dim = 30\nnoise = 0.5\n")
    table.write_text("[task_opts]\ndim = 30\nnoise = 0.5\n")
    assert load_config(flat).task_opts == load_config(table).task_opts
    assert load_config(flat).task_options.noise == 0.5
    assert load_config(table, dim=40).dim == 40
    with pytest.raises(ValueError, match="not a task option .did you mean dim"):
        RunConfig(task_opts={"dimm": 3})
    with pytest.raises(ConfigError, match="dim: Input should be greater than 0"):
        load_config(None, dim=0)


def test_an_option_the_task_does_not_read_is_refused_unless_at_its_default():
    with pytest.raises(ValueError, match="dim = 5: task mnist does not use it .it is for quadratic."):
        RunConfig(task="mnist", dim=5)
    cfg = RunConfig(task="mnist", dim=1000, alpha=0.5)
    assert "dim" not in cfg.task_opts and cfg.task_opts["alpha"] == 0.5  # (dim at its default: as if not given)
    assert cfg.task_options.lora_r is None and cfg.task_options.dim == 1000  # not read: its default


def test_the_ledger_holds_the_defaults_the_flat_fields_had():
    assert {k: defaults()[k] for k in compat.TASK_FLAT_OPTIONS} == compat.TASK_FLAT_OPTIONS
    for name, default in compat.TASK_FLAT_OPTIONS.items():  # int stays int, float float: the hash's bytes
        assert type(option_fields()[name].default) is type(default), name


def test_a_schema_4_configuration_reads_as_today_and_keeps_its_hash():
    cfg = RunConfig(dim=50, rounds=3)
    flat = {k: v for k, v in cfg.model_dump().items() if k != "task_opts"}
    old = {**flat, **compat.TASK_FLAT_OPTIONS, "dim": 50, "schema": 4}  # as schema 4 wrote it: every option flat
    raw, _ = compat.migrate(old)
    assert "dim" not in raw and raw["task_opts"]["dim"] == 50
    again = RunConfig(**raw)
    assert again.model_dump() == cfg.model_dump() and config_sha256(again) == config_sha256(cfg)
    assert compat.flat_options(cfg.model_dump())["text_column"] == "text"  # (the hash counts every one flat)


def test_a_run_records_its_task_options_and_resumes_refusing_another(tmp_path, capsys):
    out = tmp_path / "r"
    code, _, err = run_cli(["run", "--quiet", "--rounds", "2", "--dim", "8", "--out", str(out)], capsys)
    assert code == 0, err
    raw = json.loads((out / "config.json").read_text())
    assert raw["schema"] == compat.SCHEMA and raw["task_opts"]["dim"] == 8 and "dim" not in raw
    code, _, err = run_cli(["run", "--quiet", "--rounds", "2", "--dim", "9", "--out", str(out), "--resume"], capsys)
    assert code == 2 and "(dim = 8 there, 9 here)" in err


def test_a_task_of_your_own_reads_the_options_it_declares_by_name(tmp_path):
    f = tmp_path / "sized.py"
    f.write_text("import torch\nimport hiso\n\nclass Sized(hiso.Task):\n"
                 "    metrics = {'eval_loss': 'min'}\n    options = frozenset({'dim', 'data_dir'})\n"
                 "    @classmethod\n    def from_config(cls, cfg):\n"
                 "        task = cls(cfg.clients, seed=cfg.seed)\n        task.dim, task.where = cfg.dim, cfg.data_dir\n"
                 "        return task\n"
                 "    def build_model(self):\n        return torch.nn.Linear(self.dim, 1)\n"
                 "    def batch(self, c, r, k, n):\n        return torch.ones(n, self.dim)\n"
                 "    def loss(self, model, b):\n        return model(b).square().mean()\n"
                 "    def evaluate(self, model):\n        return {'eval_loss': 0.0}\n")
    from hiso.tasks.registry import build_task
    cfg = RunConfig(task=f"{f}:Sized", dim=7, data_dir=str(tmp_path), lr=0.1)
    assert cfg.task_opts == {"dim": 7, "data_dir": str(tmp_path)} and cfg.task_options.dim == 7
    task = build_task(cfg)
    assert (task.dim, task.where) == (7, str(tmp_path))
    with pytest.raises(ValueError, match="lora_r = 2: task .* does not use it"):
        RunConfig(task=f"{f}:Sized", lora_r=2, lr=0.1)
