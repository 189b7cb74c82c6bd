"""FedKSeed is a method class whose fields are its options (seed_pool, seed_sampling: flags, TOML
keys, --method-opt and a [method] table alike); older configurations with them flat still read,
with the hash they had."""

import dataclasses
import json
from pathlib import Path

import pytest

from cli_helpers import run_cli
from hiso import compat
from hiso.config import RunConfig, load_config
from hiso.core.method import Method
from hiso.methods.fedkseed_method import FedKSeed
from hiso.methods.registry import method_info
from hiso.runners.runmodel import config_sha256
from legacy_helpers import dumped_flat, flat_config_hash

POOL = ("seed_pool", "seed_sampling")
TINY = ["--task", "quadratic", "--dim", "12", "--clients", "4", "--sampled", "2", "--rounds", "3", "--quiet"]
FIXTURE = Path(__file__).parent / "fixtures" / "legacy" / "fedkseed" / "full" / "config.json"


def test_fedkseed_is_a_method_class_whose_fields_are_its_options_and_its_family_the_registrys():
    info = method_info("fedkseed")
    assert issubclass(FedKSeed, Method) and info.cls is FedKSeed
    assert tuple(f.name for f in dataclasses.fields(FedKSeed)) == POOL
    assert info.family == "seed-pool" and info.can == frozenset({"one-seed"})
    assert not set(POOL) & set(RunConfig.model_fields)
    cfg = load_config(None, algorithm="fedkseed", seed_pool=64)
    assert cfg.method_opts == {"seed_pool": 64, "seed_sampling": "weighted"}
    assert FedKSeed.of(cfg) == FedKSeed(seed_pool=64)


def test_flag_method_opt_toml_key_and_method_table_reach_the_same_field(tmp_path, capsys):
    (tmp_path / "flat.toml").write_text('algorithm = "fedkseed"\nseed_pool = 8\nseed_sampling = "uniform"\n')
    (tmp_path / "table.toml").write_text('algorithm = "fedkseed"\n[method]\nseed_pool = 8\nseed_sampling = "uniform"\n')
    fks = ["--algorithm", "fedkseed"]
    ways = {"flags": [*fks, "--seed-pool", "8", "--seed-sampling", "uniform"],
            "method-opt": [*fks, "--method-opt", "seed_pool=8", "--method-opt", "seed_sampling=uniform"],
            "toml": ["--config", str(tmp_path / "flat.toml")], "table": ["--config", str(tmp_path / "table.toml")]}
    for name, args in ways.items():
        code, _, err = run_cli(["run", "--out", str(tmp_path / name), *TINY, *args], capsys)
        assert code == 0, err
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert saved["schema"] == compat.SCHEMA and not set(POOL) & set(saved)
        assert saved["method_opts"] == {"seed_pool": 8, "seed_sampling": "uniform"}
    files = {name: (tmp_path / name / "history.bin").read_bytes() for name in ways}
    assert len(set(files.values())) == 1


@pytest.mark.parametrize("args, needle", [(["--seed-pool", "0"], "seed pool must hold 1 to 65536 seeds"),
                                          (["--method-opt", "seed_sampling=best"], "seed_sampling must be one of"),
                                          (["--seed-pool", "8", "--method-opt", "seed_pool=9"], "give it once")])
def test_a_bad_pool_option_is_one_line(tmp_path, capsys, args, needle):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), *TINY, "--algorithm", "fedkseed", *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_the_pool_options_on_another_method_are_named_and_not_kept(tmp_path, capsys):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "d"), *TINY, "--algorithm", "decomfl", "--seed-pool", "8"],
                           capsys)
    assert code == 0 and "decomfl does not use seed_pool (fedkseed's)" in err, err
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "seed_pool" not in saved and saved["method_opts"] == {}
    assert load_config(None, algorithm="hiso", seed_sampling="uniform").unused_options() == {
        "seed_sampling": "fedkseed's"}


@pytest.mark.parametrize("kw", [dict(algorithm="fedkseed", seed_pool=32, seed_sampling="uniform"),
                                dict(algorithm="fedkseed"), dict(algorithm="decomfl"), dict(algorithm="hiso", nu=0.2)])
def test_a_schema_3_configuration_with_the_flat_pool_options_reads_as_today_with_the_same_hash(kw):
    cfg = load_config(None, **kw)
    values = dumped_flat(cfg)  # the task options flat too, as then
    opts = dict(values.pop("method_opts"))
    flat = {k: opts.pop(k, d) for k, d in compat.FLAT_OPTIONS["fedkseed"].items()}
    old = {"schema": 3, **values, **flat, "method_opts": opts}  # what hiso wrote before schema 4
    raw, _ = compat.migrate(old)
    assert RunConfig(**raw).model_dump() == cfg.model_dump() and not set(POOL) & set(raw)
    # the hash is the one of the configuration with every built-in method's options flat, as before
    every = {k: opts.pop(k, d) for owner in compat.FLAT_OPTIONS.values() for k, d in owner.items()}
    assert config_sha256(cfg) == flat_config_hash({**values, **every, **flat, "method_opts": opts})


def test_the_legacy_fixtures_flat_pool_reads_into_the_method():
    raw, _ = compat.migrate(json.loads(FIXTURE.read_text()))
    assert raw["method_opts"] == {"seed_pool": 16, "seed_sampling": "weighted"} and not set(POOL) & set(raw)
    cfg = RunConfig(**{k: v for k, v in raw.items() if k != "task_info"})
    assert FedKSeed.of(cfg) == FedKSeed(seed_pool=16, seed_sampling="weighted")
