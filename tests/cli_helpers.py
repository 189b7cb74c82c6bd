"""Calling the ``hiso`` command in-process from tests."""

from hiso.cli import main


def run_cli(args, capsys):
    """(exit code, stdout, stderr) of ``hiso ARGS``; argparse's own errors exit through SystemExit."""
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
