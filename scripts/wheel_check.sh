#!/usr/bin/env bash
# The package as a user gets it: build the sdist and, from it, the wheel
# (`python -m build`), check what the wheel holds, install it into a fresh virtual
# environment and run the demo and a smoke test there, from outside the source tree. A
# module or data file (py.typed) missing from the package fails here, where the
# editable install of the tests would not notice.
#
# The venv sees the system site-packages (torch is large: the one already installed is
# used), so the wheel's own dependencies resolve without a download; the package itself
# must come from the wheel (checked: async_stager.__file__ is inside the venv). Every
# module of the installed wheel is then imported with every installed distribution
# outside torch's and the wheel's declared dependencies made unimportable
# (scripts/declared_only.py): an undeclared import (numpy before it was declared)
# fails here. WHEEL_CHECK_BARE=1 uses a venv without the system site-packages instead,
# into which pip installs the wheel and the installed torch's version (from the
# configured index: a download where torch is not on local disk).
#
#   scripts/wheel_check.sh            # exit status non-zero on any failure
#   PYTHON=python3.12 scripts/wheel_check.sh
#   WHEEL_CHECK_NO_ISOLATION=1 ...    # build with the installed setuptools (offline)
#   WHEEL_CHECK_BARE=1 ...            # a bare venv: only torch and the declared dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="$PWD"
PY="${PYTHON:-python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/wheel-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH  # the tree must not be importable from the checks below

isolation=()
if [ -n "${WHEEL_CHECK_NO_ISOLATION:-}" ]; then
    isolation=(--no-isolation)
fi
echo "+ build the sdist, then the wheel from it"
"$PY" -m build "${isolation[@]}" --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 || {
    cat "$WORK/build.log" >&2
    exit 1
}
sdist=("$WORK"/dist/async_stager-*.tar.gz)
wheel=("$WORK"/dist/async_stager-*.whl)
echo "  ${sdist[0]##*/} ($(du -k "${sdist[0]}" | cut -f1) KiB), ${wheel[0]##*/} ($(du -k "${wheel[0]}" | cut -f1) KiB)"

echo "+ the wheel holds every module of the package and py.typed; the sdist the license"
"$PY" - "$SRC" "${wheel[0]}" "${sdist[0]}" <<'EOF'
import sys
import tarfile
import zipfile
from pathlib import Path

src, wheel, sdist = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
names = set(zipfile.ZipFile(wheel).namelist())
want = {p.relative_to(src).as_posix() for p in (src / "async_stager").rglob("*.py") if "__pycache__" not in p.parts}
want.add("async_stager/py.typed")
missing = sorted(want - names)
assert not missing, f"missing from the wheel: {missing}"
stray = sorted(n for n in names if not n.startswith(("async_stager/", "async_stager-")))
assert not stray, f"files outside the package in the wheel: {stray}"
members = {m.split("/", 1)[-1] for m in tarfile.open(sdist).getnames()}
for need in ("LICENSE", "README.md", "pyproject.toml", "async_stager/py.typed"):
    assert need in members, f"missing from the sdist: {need}"
print(f"  {len(want)} package files in the wheel, py.typed among them")
EOF

VPY="$WORK/venv/bin/python"
if [ -n "${WHEEL_CHECK_BARE:-}" ]; then
    torch_version=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
    echo "+ a bare venv: the wheel and torch==$torch_version, nothing else"
    "$PY" -m venv "$WORK/venv"
    "$VPY" -m pip install --quiet --disable-pip-version-check "${wheel[0]}" "torch==$torch_version"
else
    echo "+ a fresh venv with the wheel installed"
    "$PY" -m venv --system-site-packages "$WORK/venv"
    "$VPY" -m pip install --quiet --disable-pip-version-check "${wheel[0]}"
fi

# Outside the source tree: the current folder must not put the tree on sys.path.
mkdir -p "$WORK/outside"
cd "$WORK/outside"
echo "+ every module imports with only torch and the declared dependencies"
"$VPY" "$SRC/scripts/declared_only.py" --installed
echo "+ python -m async_stager demo (from the wheel)"
"$VPY" -W error -m async_stager demo --checkpoint "$WORK/demo-ckpt"
echo "+ async-stager --help (the console script)"
"$WORK/venv/bin/async-stager" --help > /dev/null
echo "+ smoke test: import, stage, Checkpointer save and restore"
"$VPY" -W error - "$WORK" <<'EOF'
import sys
from pathlib import Path

import anyio
import torch

import async_stager
from async_stager import Checkpointer, Stager

work = Path(sys.argv[1]).resolve()
where = Path(async_stager.__file__).resolve()
assert work / "venv" in where.parents, f"async_stager imported from {where}, not from the wheel"
assert (where.parent / "py.typed").is_file(), "py.typed was not installed"


async def main() -> None:
    sd = {"w": torch.arange(1000, dtype=torch.float32), "opt": {"step": 3, "m": [torch.ones(4, 4)]}}
    async with Stager() as stager:
        staged = await stager.stage(sd)
        assert torch.equal(staged["w"], sd["w"]) and staged["opt"]["step"] == 3
        assert torch.equal(staged["opt"]["m"][0], sd["opt"]["m"][0])
    async with Checkpointer(work / "smoke-ckpt", keep=2) as ckpt:
        for step in (1, 2):
            await ckpt.save({k: v for k, v in sd.items()}, step=step)
        await ckpt.wait()
        assert ckpt.steps() == [1, 2], ckpt.steps()
    async with Checkpointer(work / "smoke-ckpt") as ckpt:
        target = {"w": torch.zeros(1000), "opt": {"step": 0, "m": [torch.zeros(4, 4)]}}
        step = await ckpt.restore(target)
    assert step == 2, step
    assert torch.equal(target["w"], sd["w"]) and torch.equal(target["opt"]["m"][0], sd["opt"]["m"][0])


anyio.run(main)
print(f"  async_stager {async_stager.__version__} from {where.parent}: staged, saved, restored")
EOF
echo "wheel check: ok"
