"""hiso.compat: config.json's schema version, and the ledgers of what older runs need."""

import importlib
import json

import pytest

from cli_helpers import run_cli
from hiso import compat
from hiso.config import RunConfig
from hiso.core.join import config_blob


def test_a_run_records_the_schema_and_a_newer_one_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "r"
    code, _, err = run_cli(["run", "--quiet", "--rounds", "2", "--dim", "8", "--out", str(out)], capsys)
    assert code == 0, err
    raw = json.loads((out / "config.json").read_text())
    assert raw["schema"] == compat.SCHEMA
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "a.pt")], capsys)
    assert code == 0, err
    raw["schema"] = compat.SCHEMA + 1
    (out / "config.json").write_text(json.dumps(raw))
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "b.pt")], capsys)
    assert code == 2 and "newer hiso" in err and len(err.strip().splitlines()) == 1


def test_migrate_gives_an_unversioned_file_the_values_its_run_had():
    raw = {"task": "squad", "task_info": {"max_length": 256}, "max_length": None}
    rest, older = compat.migrate(raw)
    assert "schema" not in rest
    assert older == {"pack_sequences": False, "directions": "torch-normal", "strip_text": False, "max_length": 256,
                     "quantize_embedding": False}
    assert compat.migrate({"schema": compat.SCHEMA, "task": "quadratic", "directions": "philox-rademacher"})[1] == {}
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match="schema"):
            compat.migrate({"schema": bad})


def test_the_fingerprint_tables_name_classes_that_exist_and_keep_the_old_blobs():
    for key in {**compat.FINGERPRINT_LEGACY_KEY, **compat.FINGERPRINT_LATER_FIELDS, **compat.FINGERPRINT_AS}:
        module, _, name = key.rpartition(".")
        assert hasattr(importlib.import_module(module), name), key  # a renamed class must move its row
    ferret = json.loads(config_blob(RunConfig(algorithm="ferret").zo()))
    assert ferret["ferret"] is not None and "grad_clip" not in ferret["ferret"] and ferret.get("method") is None
    clipped = json.loads(config_blob(RunConfig(algorithm="ferret", grad_clip=1.0).zo()))
    assert clipped["ferret"]["grad_clip"] == 1.0
    feedsign = json.loads(config_blob(RunConfig(algorithm="feedsign").zo()))
    assert feedsign["signs"] is True and feedsign.get("method") is None
    sketch = json.loads(config_blob(RunConfig(algorithm="sketch").zo()))
    assert sketch["method"]["class"].endswith("SketchConfig") and "grad_clip" not in sketch["method"]
