"""The docs' code is real: every Python block in README.md and docs/*.md runs.

Blocks are executed in order, each in a fresh namespace, from a temporary directory.
Longer programs live in examples/ (run by test_examples.py) and are referenced by path;
every path the docs mention must exist. The user guides hold Python blocks only; the
reference pages may also hold ``text`` blocks (diagrams, signatures, output) and
``bash`` blocks (commands), never an unlabelled one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.store.conftest import fault_proxy, moto_port, proxy, s3_env  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["quickstart.md", "recipes.md", "migration.md", "troubleshooting.md"]
# Every other page of docs/ (a new page's blocks run without a list to update), and the README.
REFERENCE = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in DOCS] + ["../README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)

pytestmark = [
    pytest.mark.timeout(300),  # a hang guard, not a speed check (see CONTRIBUTING.md, "Tests")
    # dcp.load(no_dist=True) warns that it assumes one process: the blocks ask for that.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def blocks(doc: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer((ROOT / "docs" / doc).read_text())]


PY_BLOCKS = [
    pytest.param(code, id=f"{doc}-{i}")
    for doc in DOCS + REFERENCE
    for i, (lang, code) in enumerate(blocks(doc))
    if lang == "python"
]


@pytest.mark.parametrize("doc", DOCS)
def test_only_python_blocks(doc: str) -> None:
    langs = [lang for lang, _ in blocks(doc)]
    assert all(lang == "python" for lang in langs), f"{doc}: untested code blocks {langs}"


@pytest.mark.parametrize("doc", REFERENCE)
def test_reference_blocks_are_labelled(doc: str) -> None:
    langs = [lang for lang, _ in blocks(doc)]
    assert all(lang in ("python", "text", "bash") for lang in langs), f"{doc}: blocks {langs}"


@pytest.mark.parametrize("doc", DOCS + REFERENCE)
def test_referenced_paths_exist(doc: str) -> None:
    text = (ROOT / "docs" / doc).read_text()
    for path in re.findall(r"`((?:examples|tests)/[\w/]+\.py)`", text):
        assert (ROOT / path).exists(), f"{doc} mentions {path}"
    for link in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", text):
        # Relative to the page itself (README.md's links start at the repository root).
        assert ((ROOT / "docs" / doc).parent / link).exists(), f"{doc} links to {link}"


@pytest.mark.parametrize("code", PY_BLOCKS)
def test_python_block_runs(
    code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    monkeypatch.chdir(tmp_path)
    for bucket in sorted(set(re.findall(r"s3://([a-z0-9][a-z0-9.-]+)/", code))):
        # A block that writes to a bucket runs against the S3 server the store tests
        # start (moto), the standard AWS variables pointing at it as a user's would.
        _s3_bucket(request, bucket)
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})


def _s3_bucket(request: pytest.FixtureRequest, name: str) -> None:
    from tests.store.conftest import admin_client

    request.getfixturevalue("s3_env")
    client = admin_client(request.getfixturevalue("moto_port"))
    try:
        client.create_bucket(Bucket=name)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
