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

The node: with ``ranks`` processes per node staging alike (``LOCAL_WORLD_SIZE`` at
run time, ``--ranks-per-node`` in ``check``), the machine-wide limits (MemAvailable,
the cgroup, /dev/shm) are judged against every rank's new bytes, capped by what a node
budget (``node_budget_bytes``) may still grant. With a node budget two rows more: one
process's need must fit the whole budget (else it can never be granted: enforced), and
the ranks' sum against the budget (information: ranks beyond it take turns).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from async_stager._core.memory.arena import MIN_ARENA_BYTES, Pinner, align
from async_stager._core.memory.host_limits import HostLimits
from async_stager._core.options import StagerOptions
from async_stager.errors import HostLimitError, NodeBudgetError

if TYPE_CHECKING:
    from async_stager._core.memory.ledger import NodeLedger

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
    pinner's pages count against RLIMIT_MEMLOCK. ``ranks``: processes per node
    staging alike; ``node_budget``: the node budget (bytes; None: none), of which
    ``node_reserved`` bytes are granted now (every rank, this one included)."""

    per_set: int
    sets: int = 1
    held_bytes: int = 0
    held_sets: int = 0
    pinned: bool = False
    shared: bool = False
    charges_memlock: bool = False
    ranks: int = 1
    node_budget: int | None = None
    node_reserved: int = 0

    @property
    def new_bytes(self) -> int:
        """Host bytes still to be mapped (this process)."""
        return max(0, self.per_set * self.sets - self.held_bytes)

    @property
    def node_new_bytes(self) -> int:
        """Host bytes still to be mapped on the node: every rank's, capped by what the
        node budget may still grant."""
        total = self.new_bytes * self.ranks
        if self.node_budget is not None:
            total = min(total, max(0, self.node_budget - self.node_reserved))
        return total

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

    def describe_node(self) -> str:
        """What the node maps: ``4 ranks x 2 x 37.2 GiB``, capped by the node budget."""
        if self.ranks == 1 and self.node_budget is None:
            return self.describe()
        text = self.describe() if self.ranks == 1 else f"{self.ranks} ranks x {self.describe()}"
        if self.node_new_bytes < self.new_bytes * self.ranks:
            text += f", at most {human(self.node_new_bytes)} (node budget)"
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
                cls = NodeBudgetError if r.resource.startswith("node budget") else HostLimitError
                raise cls(
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
    # Machine-wide limits see every rank's memory (capped by the node budget);
    # per-process ones (RLIMIT_MEMLOCK) this process's.
    memory = need.node_new_bytes
    node = need.ranks > 1 or need.node_budget is not None
    text = human(memory) if node else need.describe()
    ranks = need.ranks
    per_node = f"fewer than {ranks} ranks per node" if ranks > 1 else "fewer ranks per node"
    if need.node_budget is not None:
        fewer = f"{per_node}, or a smaller node_budget_bytes"
    elif node:
        fewer = f"{per_node}, or one node budget they share: node_budget_bytes"
    else:
        fewer = "fewer ranks or workers per node"
    if limits.mem_available is not None:
        left = limits.mem_available
        rows.append(
            Row(
                "host memory (MemAvailable)",
                memory,
                left,
                "bytes",
                f"free memory on this machine ({fewer})"
                + _fewer(need, left)
                + budget_fix(left // ranks, need.per_set),
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
                + budget_fix(cg.headroom // ranks, need.per_set),
                need_text=text,
            )
        )
    if need.node_budget is not None:
        rows += _node_rows(need)
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
                need.new_bytes,
                locked_left,
                "bytes",
                "raise it (ulimit -l; Docker --ulimit memlock=-1) or pass pin_memory=False",
                enforced=enforced,
                note=note,
                need_text=need.describe(),
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


def _node_rows(need: Need) -> list[Row]:
    """The node budget's rows: one process's whole need against the whole budget
    (enforced: more can never be granted, whatever the other ranks do), and every
    rank's against it (information: ranks beyond it wait their turn, FIFO)."""
    assert need.node_budget is not None
    own = need.per_set * need.sets
    fix = (
        "raise node_budget_bytes (every rank the same)"
        + (
            f", or lower max_buffer_sets (now {need.sets}) to 1"
            if need.sets > 1 and need.per_set <= need.node_budget
            else ""
        )
        + budget_fix(need.node_budget, need.per_set)
    )
    rows = [
        Row(
            "node budget, one rank",
            own,
            need.node_budget,
            "bytes",
            fix,
            need_text=need.describe(),
        )
    ]
    if need.ranks > 1:
        rows.append(
            Row(
                f"node budget, all {need.ranks} ranks",
                own * need.ranks,
                need.node_budget,
                "bytes",
                "ranks beyond the budget wait their turn (FIFO, bounded by buffer_wait_timeout)",
                enforced=False,
                note="staging memory counts while it stays mapped: ranks take turns only if idle ones trim()",
                need_text=f"{need.ranks} x {human(own)}",
            )
        )
    return rows


def ranks_per_node() -> int:
    """Processes of the job on this node, as the launcher says (``LOCAL_WORLD_SIZE``,
    torchrun's); 1 when it says nothing."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


#: Reads the limits for the engine's check (a module attribute: the seam for tests).
read_limits: Callable[[], HostLimits] = HostLimits.read


def engine_hook(
    options: StagerOptions,
    pinner: Pinner | None,
    *,
    reserve: bool,
    held_bytes: int,
    held_sets: int,
    ledger: NodeLedger | None = None,
) -> Callable[[list[int]], None]:
    """The check ``make_plan`` runs with the unique storages' sizes (bytes) before it
    allocates: at ``reserve()`` for ``max_buffer_sets`` sets, less what the stager
    holds; at a stage, for the one fresh buffer set it is about to fill. With a node
    ``ledger``, ``reserve()`` judges the node (``ranks_per_node()`` ranks, what the
    ledger has granted now) and both check the node budget's rows."""

    def preflight(sizes: list[int]) -> None:
        node: dict[str, int] = {}
        if ledger is not None:
            node = {
                "ranks": ranks_per_node() if reserve else 1,
                "node_budget": ledger.budget,
                "node_reserved": ledger.usage().reserved,
            }
        need = Need(
            per_set=set_bytes(sizes),
            sets=options.max_buffer_sets if reserve else 1,
            held_bytes=held_bytes if reserve else 0,
            held_sets=held_sets if reserve else 0,
            pinned=pinner is not None,
            shared=options.share_memory,
            charges_memlock=bool(getattr(pinner, "charges_memlock", False)),
            **node,
        )
        if need.new_bytes or need.descriptors:
            check(need, read_limits()).raise_if_short()

    return preflight
