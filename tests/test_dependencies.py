"""The package imports with only torch and its declared dependencies installed.

``scripts/declared_only.py`` blocks every installed distribution outside the
requirement closure of torch and ``[project].dependencies`` (no extras), then imports
every module of the package with warnings as errors: a module needing an undeclared
package (numpy, before it was declared) fails, as it would for a user who installed
the wheel next to torch. ``scripts/wheel_check.sh`` runs the same check on the
installed wheel's metadata.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "declared_only.py"

# A hang guard: one Python process importing torch and the package (3 s quiet).
pytestmark = pytest.mark.timeout(120)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_every_module_imports_with_only_the_declared_dependencies() -> None:
    proc = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "modules import with only torch and anyio, numpy, xxhash" in proc.stdout, proc.stdout


def test_an_undeclared_import_is_caught(tmp_path: Path) -> None:
    # The same check against a pyproject that does not declare numpy: the modules
    # importing it are named.
    text = (ROOT / "pyproject.toml").read_text()
    assert '"numpy>=1.24",' in text
    (tmp_path / "pyproject.toml").write_text(text.replace('"numpy>=1.24",', "", 1))
    proc = run("--pyproject", str(tmp_path / "pyproject.toml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "async_stager.dcp: ModuleNotFoundError: No module named 'numpy'" in proc.stdout, proc.stdout
