"""The documentation stays true: docs/cli.md is what the code generates, and the site builds
with --strict (a broken link, anchor or API reference fails)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import run_within
from hiso import docgen
from hiso.patience import Patience

ROOT = Path(__file__).resolve().parents[1]


def test_cli_page_is_generated():
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == docgen.render(), "docs/cli.md is out of date: run python -m hiso.docgen"


def test_cli_page_lists_every_option_and_command():
    from hiso.cli import build_parser
    from hiso.config import RunConfig

    from hiso.tasks.options import option_fields
    page = docgen.render()
    for name in [*(n for n in RunConfig.model_fields if n != "task_opts"), *option_fields()]:
        assert f"(`{name}`)" in page
    for command in docgen._subparsers(build_parser()):
        assert f"`hiso {command}" in page


def test_check_flag_reports_a_stale_page(tmp_path):
    page = tmp_path / "cli.md"
    page.write_text("# stale\n")
    assert docgen.main(["--check", "--out", str(page)]) == 1
    assert docgen.main(["--out", str(page)]) == 0
    assert docgen.main(["--check", "--out", str(page)]) == 0


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_site_builds_strict(tmp_path, monkeypatch):
    """Built as it is published (HISO_REPO_URL set): the header and the example files link into
    the repository."""
    monkeypatch.setenv("HISO_REPO_URL", "https://github.com/example/hiso")
    _build_site(tmp_path)
    page = (tmp_path / "site" / "methods-api" / "index.html").read_text()
    assert 'href="https://github.com/example/hiso"' in page
    assert 'href="https://github.com/example/hiso/blob/main/examples/clip_method.py"' in page
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="https://github.com/example/hiso/blob/main/examples/custom_task.py"' in home


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_site_builds_strict_on_a_fresh_clone(tmp_path, monkeypatch):
    """Built with no repository address given, as a newcomer builds it: no link into a repository."""
    monkeypatch.delenv("HISO_REPO_URL", raising=False)
    _build_site(tmp_path)
    page = (tmp_path / "site" / "methods-api" / "index.html").read_text()
    assert "blob/main" not in page and "examples/clip_method.py" in page


def _build_site(tmp_path):
    clock = Patience(300)  # seconds at the speed the machine offers (a loaded machine's count slower)
    r = run_within([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                    str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")], clock=clock, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "index.html").is_file()
    assert clock.used < 120


def test_repo_files_link_into_the_repository_only_where_it_is_known():
    blob = docgen.repo_blob({"repo_url": "https://github.com/o/hiso/", "edit_uri": "blob/main/docs/"})
    assert blob == "https://github.com/o/hiso/blob/main/"
    assert docgen.repo_blob({"repo_url": None}) is None
    page = ("Run `examples/clip_method.py:ScalarClip` or `configs/mnist_main.toml`, not `examples/nothing.py`.\n"
            "```bash\nhiso run --algorithm examples/clip_method.py:ScalarClip\n```\n"
            "Already linked: [`examples/clip_method.py`](x).\n")
    out = docgen.link_repo_files(page, blob, ROOT)
    assert f"[`examples/clip_method.py:ScalarClip`]({blob}examples/clip_method.py)" in out
    assert f"[`configs/mnist_main.toml`]({blob}configs/mnist_main.toml)" in out
    assert "`examples/nothing.py`" in out and f"{blob}examples/nothing.py" not in out  # no such file
    assert "```bash\nhiso run --algorithm examples/clip_method.py:ScalarClip\n```" in out  # code untouched
    assert "[`examples/clip_method.py`](x)" in out and out.count("](x)") == 1
    assert docgen.link_repo_files(page, None, ROOT) == page


def test_ci_runs_the_readme_tests_command():
    """.ci/run runs the README's tests command verbatim (the one that installs the docs extra)."""
    ci = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.startswith("python3 -m venv")]
    assert len(ci) == 1 and ci[0] in (ROOT / "README.md").read_text()
    assert "docs" in ci[0]
