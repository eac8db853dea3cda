"""The command line run in-process for tests: ``main(argv)`` with its exit code and captured output."""

import subprocess

from gradsync.cli import main


def run_cli(argv, capsys) -> subprocess.CompletedProcess:
    """``gradsync ARGV`` in this process: its exit code (SystemExit included), stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)
