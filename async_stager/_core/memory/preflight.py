"""Pre-flight: will staging this state fit this process's limits? Decided before any
host memory is mapped, so a state that cannot fit fails at ``reserve()`` (or at the
first stage into a buffer set) with a ``HostLimitError`` that names the limit, the need
and the fix, instead of an OOM kill or ENOMEM at step 10,000.

``Need`` is what the engine will allocate, estimated exactly as ``_arena`` allocates:
per buffer set one arena holding every unique source storage (views and aliases share
one) in a block rounded up to ``ALIGN`` bytes, the arena at least ``MIN_ARENA_BYTES``;
shared arenas hold two descriptors each (the memfd and Python's
``mmap`` duplicate) and are files of the arena's size (RLIMIT_FSIZE); pinning registers
each arena once. ``check`` compares it with ``HostLimits`` and returns a
``PreflightReport`` (one row per limit); ``PreflightReport.raise_if_short`` raises for
the first row that does not fit.

What counts: memory not yet mapped by this stager (what it holds is already in the
limits' usage). RLIMIT_MEMLOCK is enforced only for a pinner that charges it
(``charges_memlock = True``, e.g. one built on ``mlock``): CUDA's ``cudaHostRegister``
pins through the driver's ``get_user_pages``, which the kernel does not charge to
RLIMIT_MEMLOCK, so for it the row is shown but not enforced (containers' 64 KiB default
would otherwise refuse every pinned stager that works).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from async_stager._core.memory.arena import MIN_ARENA_BYTES, Pinner, align
from async_stager._core.memory.host_limits import HostLimits
from async_stager._core.options import StagerOptions
from async_stager.errors import HostLimitError

__all__ = [
    "Need",
    "PreflightReport",
    "Row",
    "budget_bytes_hint",
    "budget_fix",
    "check",
    "engine_hook",
    "human",
    "set_bytes",
]

#: Descriptors a shared arena holds in the staging process: the memfd and the
#: duplicate Python's ``mmap`` keeps.
FDS_PER_SHARED_ARENA = 2
#: The smallest ``host_budget_bytes`` a Checkpointer accepts (``CheckpointerOptions``).
MIN_BUDGET_BYTES = 4096


def human(n: int) -> str:
    """``n`` bytes for a person: ``64 KiB``, ``37.2 GiB`` (binary units)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            text = f"{value:.1f}".removesuffix(".0")
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def set_bytes(sizes: Iterable[int]) -> int:
    """Host bytes one buffer set maps for storages of ``sizes`` bytes (unique
    storages): one arena of their blocks (each rounded up to ``ALIGN``), at least
    ``MIN_ARENA_BYTES`` (what ``host_bytes`` reports; the kernel maps it in whole
    pages); 0 when nothing needs memory."""
    total = sum(align(n) for n in sizes if n > 0)
    if not total:
        return 0
    return max(total, MIN_ARENA_BYTES)


def budget_bytes_hint(left: int | None, per_set: int) -> int | None:
    """A concrete ``host_budget_bytes`` for a budgeted save where a staged copy does not
    fit: the largest power of two of at most half of what is ``left`` of the limit
    (bytes; the rest is for the process) and at most one buffer set's ``per_set`` bytes
    (a bigger ring holds nothing more); None when not even ``MIN_BUDGET_BYTES`` fits."""
    if left is None:
        return None
    cap = min(left // 2, max(per_set, MIN_BUDGET_BYTES))
    if cap < MIN_BUDGET_BYTES:
        return None
    return 1 << (cap.bit_length() - 1)


def budget_fix(left: int | None, per_set: int) -> str:
    """The fix that stages through a bounded ring instead of a full staged copy, with a
    concrete N (``budget_bytes_hint``); "" when no budget fits either."""
    n = budget_bytes_hint(left, per_set)
    if n is None:
        return ""
    return (
        f"; or save through a ring of N bytes instead of a staged copy: host_budget_bytes=N in "
        f"Checkpointer(...) or async_stager.dcp.save(...), e.g. N={n} ({human(n)}, at most half "
        "of what is left; N must hold the largest tensor, and a Checkpointer takes N per write "
        "in flight)"
    )


@dataclass(frozen=True)
class Need:
    """What staging needs beyond what the stager holds (bytes, descriptors).

    ``per_set``: host bytes of one buffer set (``set_bytes``); ``sets``: how many sets
    to provide for (``max_buffer_sets`` at ``reserve()``, 1 for the buffer set a stage
    is about to fill); ``held_bytes``/``held_sets``: what the stager already maps (no
    new memory for that); ``pinned``/``shared``: the options; ``charges_memlock``: the
    pinner's pages count against RLIMIT_MEMLOCK."""

    per_set: int
    sets: int = 1
    held_bytes: int = 0
    held_sets: int = 0
    pinned: bool = False
    shared: bool = False
    charges_memlock: bool = False

    @property
    def new_bytes(self) -> int:
        """Host bytes still to be mapped."""
        return max(0, self.per_set * self.sets - self.held_bytes)

    @property
    def new_sets(self) -> int:
        return max(0, self.sets - self.held_sets) if self.per_set else 0

    @property
    def descriptors(self) -> int:
        return FDS_PER_SHARED_ARENA * self.new_sets if self.shared else 0

    def describe(self) -> str:
        """``2 x 37.2 GiB`` (or ``37.2 GiB``), less what is held."""
        text = human(self.per_set) if self.sets == 1 else f"{self.sets} x {human(self.per_set)}"
        if self.held_bytes and self.new_bytes != self.per_set * self.sets:
            text += f" ({human(self.new_bytes)} not yet held)"
        return text


@dataclass(frozen=True)
class Row:
    """One limit checked: ``need`` and ``limit`` (what is left of it) in ``unit``;
    ``enforced`` False for a row shown for information (see the module doc)."""

    resource: str
    need: int
    limit: int | None
    unit: str
    fix: str
    enforced: bool = True
    note: str = ""
    need_text: str = ""

    @property
    def fits(self) -> bool:
        return self.limit is None or self.need <= self.limit

    def show(self, n: int | None) -> str:
        if n is None:
            return "unlimited"
        return human(n) if self.unit == "bytes" else f"{n}"

    @property
    def verdict(self) -> str:
        if self.fits:
            return "ok"
        return "NO" if self.enforced else "not enforced"


@dataclass(frozen=True)
class PreflightReport:
    """Every limit checked for one ``Need`` (``rows``), with ``fits`` and a table."""

    need: Need
    rows: tuple[Row, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool:
        return all(r.fits or not r.enforced for r in self.rows)

    def format(self, width: int = 80) -> str:
        """The rows as a text table: resource, need, limit (what is left), verdict."""
        head = ("resource", "need", "left of limit", "fits")
        lines = [(r.resource, r.need_text or r.show(r.need), r.show(r.limit), r.verdict) for r in self.rows]
        w0 = max(len(head[0]), *(len(x[0]) for x in lines)) if lines else len(head[0])
        w0 = min(w0, width - 44)
        out = [f"{head[0]:<{w0}}  {head[1]:>12}  {head[2]:>14}  {head[3]}"]
        for name, need, limit, verdict in lines:
            out.append(f"{name[:w0]:<{w0}}  {need:>12}  {limit:>14}  {verdict}")
        notes = [
            textwrap.fill(f"{r.resource}: {r.note}", width, initial_indent="- ", subsequent_indent="  ")
            for r in self.rows
            if r.note
        ]
        return "\n".join(out + notes)

    def raise_if_short(self) -> None:
        """Raise HostLimitError for the first enforced row that does not fit."""
        for r in self.rows:
            if r.enforced and not r.fits:
                assert r.limit is not None
                unit = "" if r.unit == "bytes" else f" {r.unit}"
                raise HostLimitError(
                    f"pre-flight: {r.resource}: staging needs {r.need_text or r.show(r.need)}{unit}, "
                    f"{r.show(r.limit)}{unit} left of the limit: {r.fix}; "
                    "nothing was allocated (pass preflight=False if this limit is misjudged)",
                    resource=r.resource,
                    need=r.need,
                    limit=r.limit,
                    unit=r.unit,
                    fix=r.fix,
                    report=self,
                )


def _fewer(need: Need, left: int) -> str:
    """``, or lower max_buffer_sets (now 2) to 1`` where fewer buffer sets fit in
    what is ``left`` (bytes); with one set, ``, or stage less per process``; "" where
    not even one set fits (no fewer sets would help)."""
    if need.sets <= 1 or need.per_set <= 0:
        return ", or stage less per process" if need.sets <= 1 else ""
    fits = min(need.sets - 1, (left + need.held_bytes) // need.per_set)
    if fits < 1:
        return ""
    return f", or lower max_buffer_sets (now {need.sets}) to {fits}"


def check(need: Need, limits: HostLimits) -> PreflightReport:
    """Compare ``need`` with ``limits``; one row per limit that applies."""
    rows: list[Row] = []
    memory = need.new_bytes
    text = need.describe()
    if limits.mem_available is not None:
        left = limits.mem_available
        rows.append(
            Row(
                "host memory (MemAvailable)",
                memory,
                left,
                "bytes",
                "free memory on this machine (fewer ranks or workers per node)"
                + _fewer(need, left)
                + budget_fix(left, need.per_set),
                need_text=text,
            )
        )
    cg = limits.cgroup
    if cg is not None:
        rows.append(
            Row(
                f"cgroup v{cg.version} {cg.file}",
                memory,
                cg.headroom,
                "bytes",
                f"raise the container's memory limit ({human(cg.limit)} at {cg.path}; Docker "
                "--memory, Kubernetes resources.limits.memory)"
                + _fewer(need, cg.headroom)
                + budget_fix(cg.headroom, need.per_set),
                need_text=text,
            )
        )
    if need.pinned:
        enforced = need.charges_memlock and not limits.ipc_lock
        locked_left = None if limits.memlock is None else max(0, limits.memlock - limits.locked)
        note = ""
        if not need.charges_memlock:
            note = "CUDA pinning (cudaHostRegister) is not charged to RLIMIT_MEMLOCK"
        elif limits.ipc_lock:
            note = "this process has CAP_IPC_LOCK, which lifts RLIMIT_MEMLOCK"
        rows.append(
            Row(
                "pinned memory (RLIMIT_MEMLOCK)",
                memory,
                locked_left,
                "bytes",
                "raise it (ulimit -l; Docker --ulimit memlock=-1) or pass pin_memory=False",
                enforced=enforced,
                note=note,
                need_text=text,
            )
        )
    if need.shared and need.new_sets:
        if not limits.memfd and limits.shm_free is not None:
            rows.append(
                Row(
                    "shared memory (/dev/shm)",
                    memory,
                    limits.shm_free,
                    "bytes",
                    "enlarge /dev/shm (Docker --shm-size) or pass share_memory=False",
                    need_text=text,
                )
            )
        if limits.fsize is not None:
            rows.append(
                Row(
                    "shared arena size (RLIMIT_FSIZE)",
                    need.per_set,
                    limits.fsize,
                    "bytes",
                    "raise it (ulimit -f unlimited) or pass share_memory=False",
                )
            )
        if limits.nofile is not None:
            rows.append(
                Row(
                    "descriptors (RLIMIT_NOFILE)",
                    need.descriptors,
                    max(0, limits.nofile - limits.open_fds),
                    "descriptors",
                    f"raise it (ulimit -n; resource.setrlimit(RLIMIT_NOFILE, ...)): {limits.open_fds} "
                    f"of {limits.nofile} are open; or close files you no longer need",
                )
            )
    return PreflightReport(need, tuple(rows))


#: Reads the limits for the engine's check (a module attribute: the seam for tests).
read_limits: Callable[[], HostLimits] = HostLimits.read


def engine_hook(
    options: StagerOptions,
    pinner: Pinner | None,
    *,
    reserve: bool,
    held_bytes: int,
    held_sets: int,
) -> Callable[[list[int]], None]:
    """The check ``make_plan`` runs with the unique storages' sizes (bytes) before it
    allocates: at ``reserve()`` for ``max_buffer_sets`` sets, less what the stager
    holds; at a stage, for the one fresh buffer set it is about to fill."""

    def preflight(sizes: list[int]) -> None:
        need = Need(
            per_set=set_bytes(sizes),
            sets=options.max_buffer_sets if reserve else 1,
            held_bytes=held_bytes if reserve else 0,
            held_sets=held_sets if reserve else 0,
            pinned=pinner is not None,
            shared=options.share_memory,
            charges_memlock=bool(getattr(pinner, "charges_memlock", False)),
        )
        if need.new_bytes or need.descriptors:
            check(need, read_limits()).raise_if_short()

    return preflight
