"""A server's end of a weight-update group over gloo, in a process of its own: what the wire does cannot end the server.

gloo checks the length of what arrives against the buffer it lands in, and a sender that sends more than the buffer
holds ends the receiving process (``std::terminate`` from gloo's own thread: no exception, no answer, every request
in the server lost).  A trainer is trusted with the weights it means to send, not with the server's life, so the
server's collectives run in a child process (``python -m cbpause.serve.receiver``): it joins the group, votes, and
receives each bucket into one of two slots of a file both processes map (``/dev/shm`` where there is one), then
answers with the bucket's header and checksum; the server checks them (``refusal`` of :mod:`cbpause.client.buckets`) and
copies the bucket out while the child receives the next one into the other slot.  A child that dies (a long sender,
a crash) is an answer too: the transfer fails, the group is closed, and the server serves on.

A transfer that stalls ends when asked: :meth:`ReceivingGroup.destroy` (the route ``/destroy_weights_update_group``,
the server's stop, a join past its timeout) kills the child, and the server's wait for its answer ends at once, where a
collective inside the server's own process would wait for the group's deadline.  The slots are two buckets (or two
tensors, in a stock trainer's format of one broadcast per tensor), whatever the model's size, reserved before use in
``/dev/shm`` or else the temporary directory (:func:`slot_file`); the server copies each bucket out of its slot into
the model (bounded staging) or into a staging buffer of its own (``--staging full``: R-STAGED-TRANSFER).  A stock
tensor carries no header: its slot is filled with a word of the transfer's own first, and a tensor whose last bytes
are still that word arrived short.

Over NCCL the tensors land on the server's own GPU, which a child cannot map; NCCL has no length check to fail, and
such a group stays in the server's process (:class:`~cbpause.client.weight_group.WeightGroup`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from typing import Any

from ..client.buckets import HEADER_WORDS, Bucket, Slot, aligned, checksum, layout, refusal, tensor_bytes, unpack

__all__ = ["ReceivingGroup"]

ANSWER_GRACE_S = 5.0  # past a collective's own deadline, how long the server waits for the child to say so
PARENT_CHECK_S = 0.2  # how often the child looks whether the server is still there
START_S = 120.0  # the most the child may take to start (importing torch) on top of the join's own timeout


class ReceivingGroup:
    """Rank ``rank`` of a weight-update group whose collectives a child process runs (see the module).  The same calls
    as :class:`~cbpause.client.weight_group.WeightGroup` on a receiving rank: ``vote``, ``receive``, ``destroy``; and
    :meth:`join`, apart from building it, so that a join under way can be destroyed (its child killed)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *, group_name: str,
                 backend: str = "gloo", timeout_s: float = 60.0, device: str | None = None) -> None:  # fmt: skip
        if backend != "gloo":
            raise ValueError("a receiving process takes gloo groups only (NCCL's tensors land on the server's GPU)")
        self.rank, self.world_size, self.backend, self.name = rank, world_size, backend, group_name
        self.timeout_s = float(timeout_s)
        self.busy = threading.Lock()  # one update at a time, as WeightGroup
        self.broken: str | None = None
        self.started = threading.Event()  # the child is up (torch imported): the join's own timeout runs from then
        self._slots: Any = None
        self._slot_bytes = 0
        self._join = {"master_address": master_address, "master_port": master_port, "rank": rank,
                      "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s}
        ours, theirs = socket.socketpair()
        with theirs:  # (its own session: a Ctrl-C at the server's terminal is the server's to handle)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "cbpause.serve.receiver", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self._conn = Connection(ours.detach())

    def join(self) -> None:
        """Wait for the child to start (:data:`START_S` at most), then for every member to join (``timeout_s``);
        ``RuntimeError`` otherwise, or when :meth:`destroy` ends it, with the child killed."""
        try:
            self._answer(START_S)
            self.started.set()
            self._ask(("join", self._join), self.timeout_s + ANSWER_GRACE_S)
        except BaseException:
            self.started.set()
            self._fail(self.broken or "the join did not complete")
            raise

    def vote(self, ok: bool) -> bool:
        return bool(self._ask(("vote", bool(ok)), self.timeout_s + ANSWER_GRACE_S))

    def receive(self, manifest: list[tuple[str, tuple[int, ...], Any]], progress: Any = None,
                bucket_bytes: int | None = None, load: Any = None) -> dict[str, Any]:  # fmt: skip
        """Every tensor of ``manifest``, staged in this process (a copy of each), as
        :meth:`~cbpause.client.weight_group.WeightGroup.receive` returns them; ``RuntimeError`` (the group closed)
        when the child dies, a bucket is refused, or an answer passes the deadline.  ``load(name, tensor)``, if
        given, takes each tensor instead, a view of the slot it arrived in, valid until it returns (nothing is
        staged then: the returned dict is empty)."""
        import torch

        if bucket_bytes is None:  # a stock trainer's format: each tensor a bucket of its own, with no header
            parts = [Bucket(i, (Slot(name, 0, tensor_bytes(shape, dtype), shape, dtype),), tensor_bytes(shape, dtype))
                     for i, (name, shape, dtype) in enumerate(manifest)]
            # (a tensor's exact length: gloo takes fewer bytes than a buffer holds, and the next one must not land)
        else:
            parts = layout(manifest, bucket_bytes)
        checked = bucket_bytes is not None
        # What a slot holds before a bucket lands: ones for a checked bucket (a short one cannot sum right), a word
        # of this transfer's own for a stock tensor (a short one leaves it at the tensor's end, where a whole one
        # ends with it once in 2**64).
        word = -1 if checked else int.from_bytes(os.urandom(8), "little", signed=True)
        received: dict[str, Any] = {}
        try:
            self._check()
            slot_bytes = aligned(max(part.nbytes for part in parts))
            self._map(2 * slot_bytes)
            self._send(("bucket", 0, parts[0].nbytes, checked, word))
            for i, part in enumerate(parts):
                answer = self._answer(self.timeout_s + ANSWER_GRACE_S)
                if i + 1 < len(parts):  # the child receives the next bucket into the other slot meanwhile
                    self._send(("bucket", ((i + 1) % 2) * slot_bytes, parts[i + 1].nbytes, checked, word))
                view = self._slots[(i % 2) * slot_bytes : (i % 2) * slot_bytes + part.nbytes]
                why = refusal(part, *answer) if checked else _short(part, view, word)
                if why is not None:
                    raise RuntimeError(why)
                with torch.no_grad():
                    for name, tensor in unpack(part, view):
                        if load is None:
                            received[name] = tensor.clone()
                        else:
                            load(name, tensor)
                if progress is not None:
                    progress()
        except BaseException as error:
            self._fail(f"{type(error).__name__}: {error}")
            if isinstance(error, OSError):  # (a slot file that cannot be made: the transfer's failure, named)
                raise RuntimeError(f"{type(error).__name__}: {error}") from error
            raise
        return received

    def destroy(self) -> None:
        """Leave the group: the child is killed (its collectives end with it, and a wait for its answer ends at once);
        idempotent, from any thread."""
        self.broken = self.broken or "destroyed"
        self.started.set()
        with contextlib.suppress(ProcessLookupError, OSError):
            self._process.kill()  # a wait for its answer, in another thread, ends at once: the peer closed
        self._slots, self._slot_bytes = None, 0  # (an update under way keeps its views, and their pages, till it ends)
        if self.busy.acquire(blocking=False):  # no update polls the connection now (an fd closed under a poll of
            try:  # another thread may stay polled, or be reused): close it; an update under way closes it itself
                self._close()
            finally:
                self.busy.release()
        threading.Thread(target=self._process.wait, name=f"cbpause-receiver-{self.name}-reap", daemon=True).start()

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()

    # ------------------------------------------------------------------------------------------------ inside

    def _map(self, nbytes: int) -> None:
        """Two slots of ``nbytes / 2`` in a file both processes map (kept for the next update if large enough)."""
        import torch

        if self._slots is not None and self._slot_bytes >= nbytes:
            return
        self._slots, self._slot_bytes = None, 0
        path = slot_file(nbytes)
        try:
            self._slots = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            self._slot_bytes = nbytes
            self._ask(("map", path, nbytes), self.timeout_s + ANSWER_GRACE_S)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)  # both mapped it: the memory lives as long as the mappings

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as error:
            self._fail(f"the receiving process is gone ({error})")
            raise RuntimeError(f"a collective of the weight-update group failed: {self.broken}") from None

    def _ask(self, message: tuple, timeout: float) -> Any:
        self._check()
        self._send(message)
        return self._answer(timeout)

    def _answer(self, timeout: float) -> Any:
        try:
            ready = self._conn.poll(timeout)
            reply = self._conn.recv() if ready else None
        except (EOFError, OSError):
            try:  # (the peer closed: the process is ending, if not ended)
                code: Any = self._process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = "none yet"
            self._fail("destroyed" if self.broken == "destroyed" else f"the receiving process ended (exit {code}): "
                       "the sender sent more than the manifest lays out, or it crashed")  # fmt: skip
            raise RuntimeError(f"a collective of the weight-update group failed: {self.broken}") from None
        if reply is None:
            self._fail(f"no answer from the receiving process within {timeout:g} s")
            raise RuntimeError(f"a collective of the weight-update group failed: {self.broken}")
        if reply[0] != "ok":
            self._fail(str(reply[1]))
            raise RuntimeError(f"a collective of the weight-update group failed: {self.broken}")
        return reply[1]

    def _check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"the weight-update group can no longer be used ({self.broken}): destroy it and "
                               "initialise it again")  # fmt: skip

    def _fail(self, why: str) -> None:
        """A collective failed or a bucket was refused (on the thread that uses the connection): the group is in an
        unknown state, and not used again."""
        self.broken = self.broken or why[:400]
        self.destroy()
        self._close()


def slot_file(nbytes: int, places: tuple[str | None, ...] = ("/dev/shm", None)) -> str:
    """A file of ``nbytes``, its space reserved (``posix_fallocate``: a file only truncated to its size takes no space
    until written, and a child writing into a full ``/dev/shm`` dies of SIGBUS), in the first of ``places`` that has
    room: ``/dev/shm``, then the temporary directory (a container's ``/dev/shm`` is 64 MiB by default).
    ``OSError`` naming each place tried when none has."""
    why = []
    for place in places:
        if place is not None and not os.path.isdir(place):
            continue
        fd, path = tempfile.mkstemp(prefix="cbpause-slots-", dir=place)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return path
        except OSError as error:
            why.append(f"{place or tempfile.gettempdir()}: {error.strerror or error}")
            with contextlib.suppress(OSError):
                os.unlink(path)
        finally:
            os.close(fd)
    raise OSError(f"no room for the {nbytes} bytes of the staging slots ({'; '.join(why)}): give /dev/shm or the "
                  "temporary directory room, or send smaller buckets")  # fmt: skip


def _short(part: Bucket, view: Any, word: int) -> str | None:
    """Why a stock tensor's bytes are short (its last bytes are still the fill ``word``'s), or None."""
    n = part.nbytes
    if n == 0:
        return None
    pattern = word.to_bytes(8, "little", signed=True)
    tail = range(max(n - 8, 0), n)
    if bytes(view[tail.start : n].tolist()) == bytes(pattern[j % 8] for j in tail):
        return (f"{part.slots[0].name!r}: fewer bytes arrived than its manifest's {n} (a short tensor, or another "
                "dtype than the manifest's)")  # fmt: skip
    return None


# ------------------------------------------------------------------------------------------------ the child


def _serve(conn: Connection) -> None:
    """The child's loop: one command at a time, one answer each, until the server closes the connection."""
    import torch

    from ..client.weight_group import WeightGroup

    group: Any = None
    slots: Any = None
    conn.send(("ok", "started"))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        try:
            kind = message[0]
            if kind == "join":
                group, answer = WeightGroup(device="cpu", **message[1]), None
            elif kind == "map":
                slots, answer = torch.from_file(message[1], shared=True, size=message[2], dtype=torch.uint8), None
            elif kind == "vote":
                answer = group.vote(message[1])
            elif kind == "bucket":
                _, offset, nbytes, checked, word = message
                view = slots[offset : offset + nbytes]
                # (the slot's own length: its start and end are aligned)
                slots[offset : offset + aligned(nbytes)].view(torch.int64).fill_(word)
                if checked:
                    head = torch.zeros(HEADER_WORDS, dtype=torch.int64)
                    group.broadcast(head)
                    group.broadcast(view)
                    answer = (head.tolist(), checksum(view))
                else:
                    group.broadcast(view)
                    answer = None
            else:
                raise ValueError(f"unknown command {kind!r}")
            conn.send(("ok", answer))
        except Exception as error:  # noqa: BLE001 -- the server's answer; the group is not used again
            conn.send(("error", f"{type(error).__name__}: {error}"[:600]))


def _die_with(parent: int) -> None:
    """End this process once the server's has ended (it is then re-parented), even inside a collective: a server
    killed mid-transfer leaves no receiver behind in the group.  (Not the kernel's PR_SET_PDEATHSIG: it fires when the
    thread that started the child ends, and the server starts it from a join's thread.)"""

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="cbpause-receiver-watch", daemon=True).start()


if __name__ == "__main__":
    _die_with(int(sys.argv[2]))
    _serve(Connection(int(sys.argv[1])))
