"""The documentation stays true: docs/cli.md is what the code generates."""

from pathlib import Path


from hiso import docgen

ROOT = Path(__file__).resolve().parents[1]


def test_cli_page_is_generated():
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == docgen.render(), "docs/cli.md is out of date: run python -m hiso.docgen"


def test_cli_page_lists_every_option_and_command():
    from hiso.cli import build_parser
    from hiso.config import RunConfig

    page = docgen.render()
    for name in RunConfig.model_fields:
        assert f"(`{name}`)" in page
    for command in docgen._subparsers(build_parser()):
        assert f"`hiso {command}" in page


def test_check_flag_reports_a_stale_page(tmp_path):
    page = tmp_path / "cli.md"
    page.write_text("# stale\n")
    assert docgen.main(["--check", "--out", str(page)]) == 1
    assert docgen.main(["--out", str(page)]) == 0
    assert docgen.main(["--check", "--out", str(page)]) == 0
