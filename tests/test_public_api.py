"""``__all__`` and the real public names stay in step (anyio's test_all_attributes)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import async_stager

pytestmark = pytest.mark.timeout(30)

API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"


#: Every name ``async_stager`` exported before the 1.0 restructuring (issue 23): each
#: stays importable from the package, advertised in ``__all__`` or not.
EXPORTED_BEFORE = [
    "AcceleratorRequiredError",
    "AttachedStateDict",
    "Backoff",
    "BudgetTooSmallError",
    "BuffersHeldError",
    "CheckpointError",
    "CheckpointStager",
    "CheckpointStagerConfig",
    "Checkpointer",
    "CheckpointerOptions",
    "Checksums",
    "ClosedError",
    "CopyError",
    "DeviceTimeoutError",
    "DefaultStager",
    "HostAllocationError",
    "HostLimitError",
    "IntegrityError",
    "InvalidOptionError",
    "InvalidOptionTypeError",
    "Lease",
    "NestingError",
    "PinningError",
    "SaveStats",
    "SharedArenaRef",
    "SharedHandle",
    "Shutdown",
    "StageStats",
    "Stager",
    "StagerOptions",
    "StagingError",
    "UncopyableObjectError",
    "UnsupportedError",
    "UnsupportedTensorError",
    "attach_shared",
    "export_shared",
    "__version__",
]


def test_all_lists_exactly_the_public_names() -> None:
    """``__all__`` is the advertised surface (about 20 names, in groups: a new one must
    earn its place); every other public attribute is a kept name (``_COMPAT``) or a
    public module."""
    advertised = list(async_stager.__all__)
    assert len(advertised) == len(set(advertised)) <= 22, advertised
    kept = set(async_stager._COMPAT)
    assert not kept & set(advertised)
    public = {
        n
        for n in vars(async_stager)
        if not n.startswith("_") and not inspect.ismodule(getattr(async_stager, n))
    }
    assert public - {"annotations"} <= set(advertised) | kept
    for name in [*advertised, *kept]:
        assert hasattr(async_stager, name), name


def test_every_name_exported_before_stays_importable() -> None:
    for name in EXPORTED_BEFORE:
        assert hasattr(async_stager, name), name


def test_errors_module_holds_the_whole_hierarchy() -> None:
    from async_stager import errors

    for name in EXPORTED_BEFORE:
        obj = getattr(async_stager, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert getattr(errors, name) is obj, name
            assert name in errors.__all__, name


def test_share_and_dcp_modules_hold_their_features() -> None:
    from async_stager import dcp, share

    for name in share.__all__:
        assert getattr(share, name) is getattr(async_stager, name)
    for name in ("DefaultStager", "CheckpointStager", "CheckpointStagerConfig"):
        assert getattr(dcp, name) is getattr(async_stager, name)
    assert callable(dcp.save) and callable(dcp.save_staged)


def test_public_objects_are_documented_and_homed_where_users_import_them() -> None:
    """Each public object reports the module a user imports it from (so reprs and
    pickles do not see the private layout) and is reachable there by its name."""
    import importlib

    for name in [*async_stager.__all__, *async_stager._COMPAT]:
        if name.startswith("__"):
            continue
        obj = getattr(async_stager, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        module = getattr(obj, "__module__", "")
        assert module in ("async_stager", "async_stager.errors", "async_stager.share"), (name, module)
        assert getattr(importlib.import_module(module), obj.__qualname__) is obj, name


def test_errors_are_one_hierarchy() -> None:
    for name in async_stager.__all__:
        obj = getattr(async_stager, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, async_stager.StagingError), name


def test_testing_module_exports() -> None:
    from async_stager import testing

    for name in testing.__all__:
        assert hasattr(testing, name)


def test_seam_types_are_exported_from_testing_and_are_the_engines() -> None:
    from async_stager import testing
    from async_stager._core.copy import device as _device
    from async_stager._core.memory import arena as _arena
    from async_stager._core.run import engine as _engine
    from async_stager.testing import Backend, Completion, Copier, Pinner

    for name in ("Backend", "Completion", "Copier", "Pinner"):
        assert name in testing.__all__, name
    engine = vars(_engine)  # the names the engine imported and types its seam with
    assert Backend is _device.Backend is engine["Backend"]
    assert Copier is _device.Copier
    assert Completion is _device.Completion is engine["Completion"]
    assert Pinner is _arena.Pinner is engine["Pinner"]
    # The fakes implement them.
    assert issubclass(testing.FakeBackend, Backend)
    assert issubclass(testing.FakeCopier, Copier)


def _api_md() -> tuple[list[str], list[str]]:
    """docs/api.md's headings and its inline code spans (outside fenced blocks)."""
    text = re.sub(r"^```.*?^```", "", API_MD.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = [line for line in text.splitlines() if line.startswith("#")]
    return headings, re.findall(r"`([^`]+)`", text)  # a span may break across lines


def test_every_public_name_is_documented_in_api_md() -> None:
    headings, spans = _api_md()
    places = [*headings, *spans]
    missing = [
        name
        for name in async_stager.__all__
        # __version__ is the packaging convention, not API to document.
        if not name.startswith("__")
        and not any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", p) for p in places)
    ]
    assert not missing, f"in async_stager.__all__ but not documented in docs/api.md: {missing}"


def test_every_name_in_api_md_headings_is_public() -> None:
    headings, _ = _api_md()
    named = [name for h in headings for name in re.findall(r"`([^`]+)`", h)]
    assert named, "docs/api.md's headings name nothing"
    for name in named:
        if "." in name:  # a module, e.g. async_stager.dcp
            assert name.startswith("async_stager."), name
            importlib.import_module(name)
        else:
            assert name in [*async_stager.__all__, *async_stager._COMPAT], (
                f"docs/api.md documents {name!r}, not a public name"
            )


def test_one_version() -> None:
    # pyproject.toml reads the version from async_stager.__version__ (one source).
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((API_MD.parent.parent / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "async_stager.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?(a|b|rc|dev|post)\d*)*", async_stager.__version__)


def test_api_md_introduction_names_every_advertised_name() -> None:
    """The page's first paragraphs, before its first section, name all of ``__all__``."""
    intro = API_MD.read_text().split("\n## ", 1)[0]
    named = set(re.findall(r"`([^`]+)`", intro))
    missing = [name for name in async_stager.__all__ if name not in named]
    assert not missing, f"docs/api.md's introduction does not name {missing}"


def test_the_public_classes_show_only_what_users_call() -> None:
    """Issue 42: what the layers above need of a Stager (a snapshot point taken now and
    staged later, the device seam, fence hooks, the shared arenas, the bytes a stage may
    reuse) is behind its internal handle, not on the class; so are the Lease's binding,
    a SaveRequest's answering and the Checkpointer's exit deadline."""
    from async_stager import Checkpointer, Lease, SaveRequest, Stager

    def shown(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert shown(Stager) == {
        "aclose",
        "buffer_sets",
        "close",
        "closed",
        "fence",
        "host_bytes",
        "lease",
        "reserve",
        "snapshot",
        "stage",
        "stats",
        "trim",
    }
    assert list(inspect.signature(Stager.lease).parameters) == ["self", "sd", "checksums"]
    assert shown(Lease) == {"checksums", "release", "released", "state_dict"}
    assert shown(SaveRequest) == {"done", "taken", "wait"}
    for cls, names in (
        (Stager, ["_shared_arenas", "snapshot_point", "add_fence_hook", "lanes", "reusable_bytes"]),
        (Lease, ["_bind"]),
        (SaveRequest, ["_take", "_finish"]),
        (Checkpointer, ["_leave_by"]),
    ):
        assert not [n for n in names if hasattr(cls, n)], cls
