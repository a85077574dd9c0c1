"""Pauses held over the network: leases (issue 29, spec section 6.6, ``tla/FleetPause.tla``).

A lease is a pause the server holds on behalf of a remote holder.  Each lease is a thread of its own, the
*lease holder*: it enters the manager's ``pause()`` (``RequestPause``, ``EnterPause``), then waits for the
resume or for its deadline.  A resume leaves the pause (``LeavePause``).  A lease not renewed within its ttl
ends its thread *without leaving* (``LeaseExpires``): the protocol sees a holder that died (``HolderDies``), and
the loop, parked in its window, releases it within ``HOLDER_CHECK_S`` (``ReleaseDeadHolder``) and logs the thread's
name, which names the lease and its holder.  So an expired lease is exactly the in-process protocol's dead holder,
checked by the same models, and nothing new runs inside the protocol.

Invariants (``FleetPause.tla``): a lease id is unguessable (``secrets.token_urlsafe``); a lease that expired or
was resumed never becomes valid again (``GoneStaysGone``): renewing, resuming or writing under it is refused; a
second resume of the same lease is idempotent; a write under a lease entered before the one the weights were last
written under is refused (``WriteOrder``: a late write never overwrites a later pause's), and so is a write while the
weights were last written under another lease that is still held (the fence, ``Unfenced``: a trainer told its update
is complete finds it in place for as long as it holds its lease, ``AckedWriteStands``); the table remembers a lease
for ``FORGET_AFTER_S`` after it ended, so that a late renewal or resume is answered truthfully (410, not 404).

A write torn after its first tensor (cut at its deadline, or failed) leaves the weights a mix, labelled
``PartialSync``, and torn (:class:`Torn`, in the same locked step as the label): the generation routes refuse new
requests, and the loop takes no step, until a complete write ends (``WriteEnd``) or the server restarts
(``R-TORN-HOLD``; ``Torn`` in ``FleetPause.tla``).  A torn update is never served.  The loop is held by the torn
write's own lease: its thread, inside the window already, stays inside after its lease ends (resumed, expired or cut)
and becomes the *keeper*.  A new holder could not join that window (once one holder has left it, a window admits no
newcomer: R-WINDOW-CLOSES), so a lease asked while the weights are torn takes no pause of its own (one that was
waiting for that window is withdrawn, ``_sweep``, and asks again): it is a *supporter*, held as the keeper's window is
(in whatever mode it was opened), and the keeper leaves only once the weights are mended and no supporter is held (a
lease asked after the mend waits for that window's close, as any newcomer does).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORGET_AFTER_S", "MAX_LEASES", "Fenced", "Lease", "LeaseGone", "LeaseTable", "Superseded", "TooManyLeases",
           "StillTorn", "Torn", "UnknownLease", "WriteBusy", "checked_seconds"]

logger = logging.getLogger("cbpause.serve")

FORGET_AFTER_S = 600.0  # how long a lease that ended is remembered (and a late renew or resume answered 410)
MAX_TTL_S = 3600.0
MAX_LEASES = 64  # leases waiting or held at once: each is a thread; a stranger must not make the server hold more
KEEPER_SWEEP_S = 0.2  # how often the keeper of torn weights looks for pauses that wait for a window it keeps open


class UnknownLease(KeyError):
    """No lease with this id was ever issued here (or it ended long ago): a 404."""


class WriteBusy(RuntimeError):
    """Another write is under way on this server (a 409): writes are one at a time (``FleetPause.tla``'s
    ``writing``), so that two copies never interleave."""


class TooManyLeases(RuntimeError):
    """The table holds ``max_leases`` leases, waiting or held, already (a 429): nothing was taken."""


class Superseded(RuntimeError):
    """A write under a lease older than the one the weights were last written under (a 409): a late write of an
    earlier pause must not overwrite a later pause's weights (``WriteOrder`` in ``FleetPause.tla``)."""


class Fenced(RuntimeError):
    """The weights were last written under another lease that is still held (a 409): its trainer may have been told
    its update is complete, and its weights stand until that lease ends (``Unfenced`` in ``FleetPause.tla``; issue 39,
    point 13).  Two trainers whose pauses reach the servers in different orders would otherwise leave the fleet mixed
    while one of them believes it updated every server.  Retry once that lease has ended (resumed or expired)."""


class LeaseGone(RuntimeError):
    """The lease expired or was resumed: it is honoured no more (a 410); ``state`` says which."""

    def __init__(self, lease: Lease) -> None:
        staged = ("; a transfer under it passed its deadline and was cut off before any tensor was copied: the "
                  "weights are as they were")
        partial = ("; a write under it passed its deadline and was cut off: the weights are torn, labelled "
                   "PartialSync, and generation is refused until a complete update")
        cut = "" if not lease.cut else staged if lease.staging else partial
        super().__init__(f"lease {lease.id} is {lease.state} (holder {lease.holder!r}); it is honoured no more{cut}")
        self.state = lease.state


@dataclass
class Torn:
    """The weights are a mix: ``version`` is the update whose write stopped after its first tensor (they are labelled
    ``PartialSync(version)``); ``names``, every tensor the torn writes were to write, which a write must cover to mend
    them (a write of fewer, a label alone, would leave the mix in place under a clean label)."""

    version: Any
    names: frozenset = frozenset()


class StillTorn(RuntimeError):
    """A write to a server whose weights are torn that does not cover every tensor the torn writes were to write (a
    409): it could not mend them, so it is refused before anything is copied (``WriteRefused``)."""


def checked_seconds(name: str, value: Any, *, default: float | None, upper: float | None = None,
                    zero: bool = True) -> float | None:  # fmt: skip
    """A duration from a request: ``default`` for ``None``; ``ValueError`` for anything not a finite non-negative
    number (a bool, a string, NaN), for 0 when ``zero`` is false, and above ``upper``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"),):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}")
    if value < 0 or (not zero and value == 0):
        raise ValueError(f"{name} must be {'positive' if not zero else 'non-negative'}, not {value!r}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be at most {upper} s, not {value!r}")
    return float(value)


@dataclass(eq=False)
class Lease:
    """One pause held over the network.  ``state``: ``waiting`` (its holder thread waits for the window),
    ``held``, then ``resumed``, ``expired`` or ``failed`` (the pause was never entered: ``error`` says why)."""

    id: str
    holder: str
    mode: str
    ttl: float
    deadline: float  # on the table's clock
    legacy: bool = False  # taken by a route without leases (vLLM's /pause, SGLang's /pause_generation)
    state: str = "waiting"
    error: BaseException | None = None
    ended_at: float | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    _resume: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    context: Any = None  # an expired lease's pause() context manager, kept so that the loop releases its hold
    busy: int = 0  # 1 while a write runs under this lease: it does not expire during it, until the write's deadline
    write_deadline: float = float("inf")  # the deadline of the writes under way (on the table's clock)
    writing: Any = None  # the version the write under way sets
    cut: bool = False  # a write under way passed its deadline: the lease ended without it, the weights are partial
    write_ended: bool = False  # the write under way was committed (WriteEnd) or failed (WriteFail)
    staging: bool = False  # the write under way receives into staging buffers, the model untouched (until Received)
    names: frozenset = frozenset()  # the tensors the write under way is to write (the model's names)
    seq: int = 0  # the order in which the leases were entered (FleetPause.tla's epochs)
    on_entered: Callable[[], None] | None = None  # called once from the lease's thread when ``entered`` is set
    abandoned: bool = False  # its asker left before the window opened: the pause is left as soon as it is entered
    resume_asked: bool = False  # a resume came: the lease ends (ResumeLease) once no write runs under it
    left: threading.Event = field(default_factory=threading.Event)  # its pause left, died, or handed to the keeper
    holds: list = field(default_factory=list)  # its pause's hold, once requested (the keeper's sweep withdraws it)
    rejoin: bool = False  # its request was withdrawn for torn weights: it is held as a supporter instead


class LeaseTable:
    """The leases of one server's manager.  Thread-safe; the HTTP routes call it from worker threads.

    ``clock`` is monotonic; :meth:`wall` converts a deadline to the Unix time the routes report.
    """

    def __init__(self, manager: Any, *, default_ttl: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 max_leases: int = MAX_LEASES, log: Callable[[dict], None] | None = None) -> None:  # fmt: skip
        self.manager = manager
        self.default_ttl = checked_seconds("default ttl", default_ttl, default=30.0, upper=MAX_TTL_S, zero=False)
        if isinstance(max_leases, bool) or not isinstance(max_leases, int) or max_leases < 1:
            raise ValueError(f"max_leases must be a positive integer, not {max_leases!r}")
        self.max_leases = max_leases
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.expired = 0  # leases that ran out, since start
        self._entered = 0  # leases entered so far: the next one's seq
        self.written_seq = 0  # the seq of the lease the weights were last written under (0: none)
        self._written_by: Lease | None = None  # that lease (FleetPause.tla's wroteEp): the fence asks if it is held
        self._writer: Lease | None = None  # the lease whose write runs now (one at a time; a cut one frees the slot)
        # Held around each tensor's copy (ModelWriter.load) and each commit: a cut write's copy that is under way
        # when the next write begins lands before that write's first tensor and before its commit, never after.
        self.copying = threading.Lock()
        # The log of the table's actions, FleetPause.tla's names (tla/TraceFleetPause.tla replays it): each record is
        # taken under the lock, in the order the actions happened.  ``ver`` is what the model's ver[s] is then: the
        # seq of the lease the weights were last fully written under, or minus that seq for a cut write (the
        # model's Partial(seq); cbpause.tlc.fleet_traces writes it so).
        self._log = log
        self._ver: tuple[str, int] = ("full", 0)
        self._torn: Torn | None = None  # the weights are a mix (FleetPause.tla's Torn)
        self._keeper: Lease | None = None  # the lease whose thread holds the loop for torn weights (see the module)
        self._kept = threading.Event()  # set to let the keeper's thread leave
        self._supporters: set[Lease] = set()  # leases held through the keeper's window, with no pause of their own

    @property
    def torn(self) -> Torn | None:
        """The weights are a mix (a write stopped after its first tensor), until a complete write ends; the
        generation routes refuse while it is set, and the loop takes no step."""
        return self._torn

    def wall(self, deadline: float) -> float:
        return time.time() + (deadline - self._clock())

    # ------------------------------------------------------------------------------------------- the routes' calls

    def pause_lease(self, *, mode: str = "keep", timeout: float | None = None, ttl: float | None = None,
                    holder: str = "anonymous", legacy: bool = False) -> Lease:  # fmt: skip
        """``PauseLease``: a new lease, returned once its pause is entered (the window is open, R-EXCLUSION).

        Raises as ``manager.pause()`` does (``TimeoutError`` after ``timeout`` s, ``RuntimeError`` when the loop
        is not running, ``ValueError`` for a bad mode), with nothing held.  The ttl counts from the entry.
        :meth:`start_lease` is the same without the wait (the HTTP route awaits ``on_entered`` instead, so that a
        waiting pause holds no worker thread).
        """
        lease = self.start_lease(mode=mode, timeout=timeout, ttl=ttl, holder=holder, legacy=legacy)
        lease.entered.wait()
        if lease.error is not None:
            raise lease.error
        return lease

    def start_lease(self, *, mode: str = "keep", timeout: float | None = None, ttl: float | None = None,
                    holder: str = "anonymous", legacy: bool = False,
                    on_entered: Callable[[], None] | None = None) -> Lease:  # fmt: skip
        """``PauseLease``, asked: the lease's thread is started and the lease returned at once, ``waiting``; its
        ``entered`` event is set (and ``on_entered`` called, from that thread) once the pause is entered or has
        failed (``error``).  ``ValueError`` for a bad argument, :class:`TooManyLeases` when ``max_leases`` leases
        wait or are held already; nothing is taken then."""
        ttl = checked_seconds("ttl", ttl, default=self.default_ttl, upper=MAX_TTL_S, zero=False)
        timeout = checked_seconds("timeout", timeout, default=None, upper=MAX_TTL_S)
        if not isinstance(holder, str) or not holder or len(holder) > 200:
            raise ValueError(f"holder must be a non-empty string of at most 200 characters, not {holder!r}")
        lease = Lease(secrets.token_urlsafe(24), holder, mode, ttl, float("inf"), legacy, on_entered=on_entered)
        with self._lock:
            self._forget_old()
            live = sum(1 for other in self._leases.values() if other.state in ("waiting", "held"))
            if live >= self.max_leases:
                raise TooManyLeases(f"this server holds {live} leases (waiting or held), its most: resume one first")
            self._leases[lease.id] = lease
        lease.thread = threading.Thread(target=self._hold, args=(lease, timeout), daemon=True,
                                        name=f"cbpause-lease-{lease.id[:8]}-{holder[:40]}")  # fmt: skip
        lease.thread.start()
        return lease

    def abandon(self, lease: Lease) -> None:
        """The asker of a lease left before it heard of it (its connection closed while the window opened): the
        lease's pause is left as soon as it is entered, or now if it was (nobody else knows its id)."""
        with self._lock:
            if lease.state == "waiting":
                lease.abandoned = True
            elif lease.state == "held":
                lease.resume_asked = True
                lease._resume.set()

    def renew_lease(self, lease_id: str, ttl: float | None = None) -> Lease:
        """``RenewLease``: push the deadline to now + ttl (the lease's own ttl by default)."""
        with self._lock:
            try:
                lease = self._live(lease_id)
            except LeaseGone:
                self._record("RenewRefused", self._find(lease_id))
                raise
            if ttl is not None:
                lease.ttl = checked_seconds("ttl", ttl, default=None, upper=MAX_TTL_S, zero=False)
            lease.deadline = self._clock() + lease.ttl
            self._record("RenewLease", lease)
            return lease

    def resume_lease(self, lease_id: str) -> bool:
        """``ResumeLease``: leave the lease's pause, once no write runs under it (the loop must not step while the
        weights change; a write that passes its deadline is cut, and the lease ends so instead).  True if this call
        asked the resume, False if one was asked before (idempotent); ``LeaseGone`` if it expired, or if the write
        under way was cut at its deadline while the resume waited (the lease then ended as expired, without leaving:
        found by review, it answered True), ``UnknownLease`` if no such lease.  Returns once the lease's thread has left
        the pause: at once, or once the write under way has ended."""
        with self._lock:
            lease = self._find(lease_id)
            if lease.resume_asked or lease.state == "resumed":
                return False
            if lease.state != "held":
                raise LeaseGone(lease)
            lease.resume_asked = True
            lease._resume.set()
        lease.left.wait(lease.ttl + MAX_TTL_S)  # the window closes if it was the last (and no weights are torn)
        if lease.state == "expired":  # the write under way was cut: the lease ended without the resume
            raise LeaseGone(lease)
        return True

    def resume_legacy(self) -> int:
        """A resume without a lease (vLLM's ``/resume``, SGLang's ``/continue_generation``): resumes every lease a
        legacy pause took, and no other.  Returns how many."""
        with self._lock:
            legacy = [lease.id for lease in self._leases.values() if lease.legacy and lease.state == "held"]
        return sum(self._resume_quietly(lease_id) for lease_id in legacy)

    def issued(self, lease_id: Any) -> bool:
        """Whether this table issued ``lease_id`` (and still remembers it: ``FORGET_AFTER_S``), whatever its state."""
        with self._lock:
            return isinstance(lease_id, str) and lease_id in self._leases

    def check_held(self, lease_id: Any, *, locked: bool = False) -> Lease:
        """The lease, if it is held now (a write must come under a held lease); else ``UnknownLease``/``LeaseGone``."""
        if not isinstance(lease_id, str):
            raise UnknownLease(f"lease_id must be a string, not {lease_id!r}")
        if locked:
            return self._live(lease_id)
        with self._lock:
            return self._live(lease_id)

    @contextmanager
    def write_weights(self, lease_id: Any, timeout: float | None = None, version: Any = None, *,
                      staged: bool = False, names: Any = ()) -> Iterator[Lease]:  # fmt: skip
        """``WriteBegin`` .. ``WriteEnd`` under a held lease: the lease does not expire (nor its pause end) before the
        block ends or ``timeout`` seconds pass (default: the lease's ttl), so the loop takes no step while the
        weights change.  Past that deadline the write is *cut* (``WriteCut``): the lease ends without it (expired, even
        if a resume waits: that resume answers ``LeaseGone``), the weights are labelled ``PartialSync(version)`` in the
        same locked step, while the hold is still in place, and :meth:`commit_write` refuses.  So a write that hangs (a
        trainer, a filesystem) parks the server for ``timeout`` at most (R-LEASE-EXPIRES); a device copy that hangs
        inside a tensor also keeps ``copying``, so the next write waits for it (never two copies at once).
        ``UnknownLease``/``LeaseGone`` if the lease is not held now, ``WriteBusy`` while another write runs,
        ``Superseded`` under an older lease than the last writer's, and ``Fenced`` while the last writer's lease,
        another one, is still held (R-WRITE-FENCE).  ``staged``: the write first receives its tensors into buffers of
        its own (a transfer, R-STAGED-TRANSFER): until :meth:`received` the model is untouched, so a cut or a failure
        then leaves the weights and their label as they were.  ``names``: the tensors the write is to write; while the
        weights are torn a write must name every tensor the torn writes were to write (``StillTorn`` otherwise: a
        write of fewer could not mend them, R-TORN-HOLD)."""
        names = frozenset(names)
        with self._lock:
            try:
                lease = self.check_held(lease_id, locked=True)
            except LeaseGone:
                self._record("WriteRefused", self._find(lease_id))
                raise
            timeout = checked_seconds("write_timeout", timeout, default=lease.ttl, upper=MAX_TTL_S, zero=False)
            if self._writer is not None:
                self._record("WriteRefused", lease)
                raise WriteBusy(f"a write under lease {self._writer.id[:8]} of {self._writer.holder!r} is under way "
                                "on this server: writes are one at a time; retry when it has ended")
            if lease.seq < self.written_seq:
                self._record("WriteRefused", lease)
                raise Superseded(f"lease {lease.id[:8]} of {lease.holder!r} is older than the lease the weights "
                                 "were last written under: this late write would overwrite a later one; refused")
            last = self._written_by
            if last is not None and last is not lease:
                self._look(last)  # a last writer past its deadline is gone already (LeaseExpires, then the write)
                if last.state == "held":
                    self._record("WriteRefused", lease)
                    raise Fenced(f"the weights were last written under lease {last.id[:8]} of {last.holder!r}, which "
                                 "is still held: they stand until it ends (another trainer may have been told its "
                                 "update is complete); retry once it has been resumed or has expired")
            if self._torn is not None and not self._torn.names <= names:
                self._record("WriteRefused", lease)
                missing = sorted(self._torn.names - names)
                raise StillTorn(f"the weights are torn (an update stopped half-way): a write mends them only if it "
                                f"sends every tensor that update was to write, {len(missing)} of which it does not "
                                f"(e.g. {missing[0]!r}); refused before anything was copied")  # fmt: skip
            self.written_seq, self._written_by = lease.seq, lease
            lease.busy, lease.cut, lease.write_ended, self._writer = 1, False, False, lease
            lease.staging, lease.names = staged, names
            lease.write_deadline = self._clock() + timeout
            lease.writing = version
            self._record("WriteBegin", lease)
        lease._resume.set()  # the lease's thread waits until the write's deadline now, not its own (found by a test)
        try:
            yield lease
        finally:
            self.fail_write(lease)  # a block left without commit_write: the write failed (a no-op after its end)
            with self._lock:
                lease.busy = 0
                lease.write_deadline = float("inf")
                if self._writer is lease:
                    self._writer = None
            lease._resume.set()  # the lease's thread looks again (a resume may wait for this write)

    def progress(self, lease: Lease, seconds: float) -> None:
        """A transfer under way moved on (a tensor arrived): its write's deadline is pushed to ``seconds`` from now, so
        that a lease never expires under a transfer that progresses, and one that stops ends within ``seconds``."""
        with self._lock:
            if lease.busy and not lease.cut:
                lease.write_deadline = max(lease.write_deadline, self._clock() + seconds)

    def received(self, lease: Lease) -> None:
        """``Received``: every tensor of a staged write arrived; from here on the copy touches the model (a cut or a
        failure labels the weights partial).  ``LeaseGone`` if the write was cut first."""
        with self.copying, self._lock:
            if lease.cut:
                raise LeaseGone(lease)
            lease.staging = False
            self._record("Received", lease)

    def commit_write(self, lease: Lease, commit: Callable[[], None]) -> None:
        """The end of a write (``WriteEnd``): ``commit()`` (set the version) under the table's lock, unless the write
        was cut (``LeaseGone``): the cut and the commit exclude each other, so a cut write never labels the weights
        as complete."""
        with self.copying, self._lock:
            if lease.cut:
                raise LeaseGone(lease)
            commit()
            self._ver = ("full", lease.seq)
            lease.write_ended = True
            self._torn = None
            self._let_keeper_go()
            self._record("WriteEnd", lease)

    def fail_write(self, lease: Lease, label: Callable[[], None] | None = None) -> None:
        """A write that failed before its end (``WriteFail``): a copy that raised, or anything that left the write
        block early.  ``label()``, when given, labels the weights partial (some tensors were copied): under the
        table's lock, unless the write was cut (its cut labelled them already)."""
        with self.copying, self._lock:
            if lease.cut or lease.write_ended:
                return
            if label is not None:
                label()
                self._ver = ("partial", lease.seq)
                self._tear(lease)
            lease.write_ended = True
            self._record("WriteFail", lease)

    def held(self) -> list[Lease]:
        with self._lock:
            return [lease for lease in self._leases.values() if lease.state == "held"]

    def close(self) -> None:
        """Resume every lease, and leave at once every pause still waiting to be entered (the server stops).  Torn
        weights stay held (the keeper does not leave): the loop must not step on them, not even to flush the requests
        in flight; :meth:`release_torn` lets it go once the loop has stopped."""
        with self._lock:
            self._supporters.clear()
            for lease in self._leases.values():
                if lease.state == "waiting":
                    lease.abandoned = True
            ids = [lease.id for lease in self._leases.values() if lease.state == "held"]
        for lease_id in ids:
            self._resume_quietly(lease_id)

    def release_torn(self) -> None:
        """The server's loop has stopped: the keeper of torn weights leaves (a restart loads the checkpoint's)."""
        with self._lock:
            self._torn = None
            self._supporters.clear()
            self._let_keeper_go()

    # ------------------------------------------------------------------------------------------- inside

    def _resume_quietly(self, lease_id: str) -> bool:
        try:
            return self.resume_lease(lease_id)
        except (LeaseGone, UnknownLease):
            return False

    def _find(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is None:
            raise UnknownLease(f"no lease {lease_id!r} here")
        return lease

    def _live(self, lease_id: str) -> Lease:
        """The lease if held and not past its deadline (the caller holds the lock).  A lease past its deadline
        whose thread has not noticed yet is already gone: it is honoured no more (``GoneStaysGone``)."""
        lease = self._find(lease_id)
        self._look(lease)
        if lease.state != "held":
            raise LeaseGone(lease)
        return lease

    def _look(self, lease: Lease) -> None:
        """Expire the lease if its time is up, and cut its write if the write's is (the caller holds the lock):
        ``LeaseExpires`` once past its deadline with no write under way, ``WriteCut`` once a write under it is past
        the write's deadline (whatever the lease's own), and nothing once a resume was asked and no write runs (the
        lease's thread is about to leave: ``ResumeLease``)."""
        now = self._clock()
        if lease.state != "held" or (lease.resume_asked and not lease.busy):  # a resume asked in time wins
            return
        if lease.busy and now >= lease.write_deadline:  # WriteCut, whatever the lease's own deadline
            self.lease_expires(lease)
        elif not lease.busy and now >= lease.deadline:  # LeaseExpires
            self.lease_expires(lease)

    def _cut(self, lease: Lease) -> None:
        """``WriteCut`` (the caller holds the lock): the weights are labelled partial here (unless the write still
        receives into its staging buffers: then nothing was copied, R-STAGED-TRANSFER), in the same locked step that
        frees the write slot, as the model's one step does: the next writer's commit comes after the label, never
        before it (found by review: the lease's thread labelled them later, over the next trainer's version)."""
        lease.cut = True
        self._writer = None  # the slot is free: a hung copy checks ``cut`` before each tensor, and stops there
        if lease.staging:  # nothing was copied: the weights are whole, and keep their label (R-STAGED-TRANSFER)
            logger.error("a transfer under lease %s of holder %r passed its deadline and was cut off before any "
                         "tensor was copied: the lease ends without it; the weights are as they were", lease.id[:8],
                         lease.holder)  # fmt: skip
            return
        self._label_partial(lease)  # the cut lease's hold is still in place: its thread has not left the pause
        self._ver = ("partial", lease.seq)
        self._tear(lease)
        logger.error("a write under lease %s of holder %r passed its deadline and was cut off: the lease ends without "
                     "it, and the weights are labelled PartialSync(%r) until a full update", lease.id[:8],
                     lease.holder, lease.writing)  # fmt: skip

    def lease_expires(self, lease: Lease) -> None:
        """``LeaseExpires`` (the caller holds the lock): the lease ends, and its thread ends without leaving; a write
        under way is cut (:meth:`write_weights`)."""
        lease.state, lease.ended_at = "expired", self._clock()
        self.expired += 1
        if lease.busy:
            self._cut(lease)
            self._record("WriteCut", lease)
        else:
            self._record("LeaseExpires", lease)
        lease._resume.set()
        if not lease.cut:  # a cut is logged by _cut
            logger.warning("lease %s of holder %r (%s pause) expired: not renewed within its ttl of %s s; the loop "
                           "releases its pause as a dead holder's", lease.id[:8], lease.holder, lease.mode, lease.ttl)

    def _label_partial(self, lease: Lease) -> None:
        """The weights of a cut write are a mix: labelled while the cut lease's hold is still in place
        (``set_weight_version`` needs a pause; it takes no lock, so calling it under the table's is safe)."""
        from ..integrations.weights import PartialSync

        try:
            self.manager.set_weight_version(PartialSync(lease.writing))
        except Exception:  # noqa: BLE001 -- logged: the label is the best effort of a server already in trouble
            logger.exception("could not label the weights of lease %s as partial", lease.id[:8])

    def _tear(self, lease: Lease) -> None:
        """The weights are a mix (the caller holds the lock, and ``lease``, whose write tore them, holds the loop: its
        thread is inside the window).  Its thread becomes the keeper, unless there is one: it will not leave the
        window, whatever becomes of its lease, until :meth:`_let_keeper_go`."""
        self._torn = Torn(lease.writing, lease.names | (self._torn.names if self._torn is not None else frozenset()))
        if self._keeper is None:
            self._keeper, self._kept = lease, threading.Event()
        self._sweep()
        logger.error("the weights are torn (a write under lease %s of holder %r stopped after its first tensor): "
                     "generation is refused, and the loop held, until a complete update", lease.id[:8],
                     lease.holder)  # fmt: skip

    def _sweep(self) -> None:
        """Withdraw every pause that waits for a window while the keeper holds the loop (the caller holds the lock):
        queued at the window the keeper keeps from closing, or asking for a stronger mode than it was opened in, it
        would wait for ever; withdrawn, its lease is held as a supporter (``rejoin``)."""
        protocol = getattr(self.manager, "background_thread_status", None)
        for lease in self._leases.values():
            if lease.state != "waiting" or not lease.holds or lease.holds[0].state not in ("queued", "waiting"):
                continue
            lease.rejoin = True
            try:
                protocol.interrupt(lease.holds[0])
            except (RuntimeError, AttributeError):  # it entered, or left, meanwhile
                pass

    def _let_keeper_go(self) -> None:
        """The keeper may leave once the weights are whole and no supporter is held (the caller holds the lock)."""
        if self._keeper is not None and self._torn is None and not self._supporters:
            self._keeper = None
            self._kept.set()

    def _record(self, action: str, lease: Lease) -> None:
        """One record of the log (the caller holds the lock): the action, the lease's epoch (its seq), and the model's
        ``ver`` after it."""
        if self._log is None or not lease.seq:
            return
        kind, seq = self._ver
        record = {"a": action, "e": lease.seq, "ver": seq if kind == "full" else -seq, "torn": self._torn is not None}
        if action == "WriteBegin" and lease.staging:
            record["staged"] = True
        self._log(record)

    @staticmethod
    def _entered_now(lease: Lease) -> None:
        lease.entered.set()
        if lease.on_entered is not None:
            try:
                lease.on_entered()
            except RuntimeError:  # the asker's event loop closed (the server stops): nobody waits any more
                pass

    def _forget_old(self) -> None:
        now = self._clock()
        old = [k for k, v in self._leases.items() if v.ended_at is not None and now - v.ended_at > FORGET_AFTER_S]
        for lease_id in old:
            del self._leases[lease_id]

    def _hold(self, lease: Lease, timeout: float | None) -> None:
        """The lease holder's thread: enter, wait for the resume or the deadline, then leave or end without leaving;
        or, as the keeper of torn weights, stay inside until they are mended (see the module)."""
        try:
            while True:
                with self._lock:  # torn weights: the keeper holds the loop, and no newcomer could join its window
                    supporter = self._torn is not None and self._keeper is not None
                    if supporter:
                        self._supporters.add(lease)
                    lease.rejoin = False
                    lease.holds.clear()
                pause: Any = contextlib.nullcontext() if supporter else \
                    self.manager.pause(timeout=timeout, mode=lease.mode, into=lease.holds)  # fmt: skip
                try:
                    pause.__enter__()
                    break
                except BaseException:
                    if not lease.rejoin:
                        raise
                    # withdrawn by the keeper's sweep (_sweep): ask again, a supporter now (or a pause of its own, once
                    # the weights are whole again)
        except BaseException as error:  # nothing is held (pause() withdrew the request)
            with self._lock:
                lease.state, lease.error, lease.ended_at = "failed", error, self._clock()
                self._supporters.discard(lease)
            lease.left.set()
            self._entered_now(lease)
            return
        with self._lock:
            self._entered += 1
            lease.state, lease.deadline, lease.seq = "held", self._clock() + lease.ttl, self._entered
            self._record("PauseLease", lease)
            if lease.abandoned:  # its asker left: nobody knows its id, so nobody would resume it
                lease.resume_asked = True
        self._entered_now(lease)
        while True:
            with self._lock:
                self._look(lease)
                if lease.state == "expired":
                    # HolderDies: this thread ends inside the pause.  The context manager stays referenced by the
                    # lease, so that the loop releases the hold (ReleaseDeadHolder), not the garbage collector.
                    lease.context = pause
                    break
                if lease.resume_asked and not lease.busy:  # ResumeLease: once no write runs under it
                    lease.state, lease.ended_at = "resumed", self._clock()
                    self._record("ResumeLease", lease)
                    break
                # The next moment _look may change something: the lease's deadline, or with a write under way the
                # later of it and the write's (a write that ends, a resume or a renewal wakes this thread earlier
                # or finds it waking at the old deadline, to wait again).
                end = lease.write_deadline if lease.busy else lease.deadline
                remaining = None if end == float("inf") else max(end - self._clock(), 0.0)
            lease._resume.wait(remaining)
            lease._resume.clear()
        with self._lock:
            keeping, kept = self._keeper is lease, self._kept
            if supporter:
                self._supporters.discard(lease)
                self._let_keeper_go()
        if keeping:  # the weights are torn: this thread holds the loop until they are mended; its lease has ended
            lease.left.set()
            while not kept.wait(KEEPER_SWEEP_S):
                with self._lock:
                    if self._torn is not None:  # (once mended, a pause waits for this window's close as any does)
                        self._sweep()
            lease.context = None
        elif lease.state == "expired":
            lease.left.set()
            return
        pause.__exit__(None, None, None)  # LeavePause
        lease.left.set()
