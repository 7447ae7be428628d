"""``check --help`` says every exit status the command returns (issue 41, section 4):
0 it fits, 1 it does not, 2 a usage error (which the command returns)."""

from __future__ import annotations

import re

import pytest

from async_stager._cli import main as cli

pytestmark = pytest.mark.timeout(60)


def test_check_help_names_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for status in ("0", "1", "2"):
        assert re.search(rf"\b{status}: ", text), (status, text)
    assert "usage error" in text
    # And 2 is what a usage error returns.
    assert cli.main(["check", "--bytes", "12zz"]) == 2
    assert cli.main(["check"]) == 2
