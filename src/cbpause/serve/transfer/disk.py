"""Weights from disk, a transport (:mod:`cbpause.integrations.transfer`): the safetensors files a trainer writes,
checked whole from their headers before anything is read, then delivered tensor by tensor.

Decisions: the path must resolve (symbolic links followed) inside the server's ``--weights-dir``, and so must each
file read from a directory, so that an HTTP client cannot make the server read an arbitrary file; only regular files
are read (a FIFO would block the reader); it is one ``.safetensors`` file or a directory of them;
the tensors may be a subset of the model's parameters and buffers (a trainer may send only what it trained), but
every name must be one of the model's (wrappers' prefixes stripped as TRL's sync strips them), with its shape and
dtype.  Every name, shape and dtype is read from the files' headers and checked when the transport is made
(:class:`Disk`): any mismatch is a ``ValueError`` and the model is left untouched.  The tensors are then read one at a
time (``pread``) from the files opened at that check, so a server holds one tensor of the update, not the update.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["Disk", "check_inside", "weight_files", "weight_info"]

# The dtypes a safetensors header names, as torch's (safetensors' own table, by name: no tensor read).
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # fmt: skip


def check_inside(path: Any, root: Path | None) -> Path:
    """``path`` resolved; ``PermissionError`` when no weights directory was configured, ``ValueError`` when the path
    is not a string, lies outside ``root``, or does not exist."""
    if root is None:
        raise PermissionError("this server was started without --weights-dir: updates from disk are disabled")
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty string, not {path!r}")
    try:  # a name too long, a loop of links, a NUL: the file system's refusal is the client's 400
        resolved = (root / path).resolve() if not Path(path).is_absolute() else Path(path).resolve()
        if not resolved.is_relative_to(root.resolve()):
            raise ValueError(f"path {path[:200]!r} is outside the weights directory {str(root)!r}")
        if not resolved.exists():
            raise ValueError(f"path {path[:200]!r} does not exist")
    except (OSError, RuntimeError) as error:
        raise ValueError(f"path {path[:200]!r} cannot be read: {type(error).__name__}: {error}"[:400]) from None
    return resolved


def weight_files(path: Path, root: Path | None = None) -> list[Path]:
    """The files to read at ``path`` (resolved): itself, or the ``*.safetensors`` entries of a directory, each resolved
    (symbolic links followed) and refused unless it lies inside ``root`` and is a regular file.  A FIFO, a device or a
    socket would block the reader or never end; a link out of ``root`` would read what the server must not."""
    entries = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    files = []
    for entry in entries:
        try:
            resolved = entry.resolve()
        except (OSError, RuntimeError) as error:  # a loop of links
            raise ValueError(f"{entry.name}: cannot be resolved ({error})") from None
        if root is not None and not resolved.is_relative_to(root.resolve()):
            raise ValueError(f"{entry.name} links to {str(resolved)!r}, outside the weights directory {str(root)!r}")
        try:
            mode = resolved.stat().st_mode
        except OSError as error:
            raise ValueError(f"{entry.name}: cannot be read ({error})") from None
        if not stat.S_ISREG(mode):
            raise ValueError(f"{entry.name} is not a regular file: only regular files are read")
        files.append(resolved)
    if not files:
        raise ValueError(f"no .safetensors file at {str(path)!r}")
    return files


MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header


class Disk:
    """The tensors under ``path`` (resolved; its files inside ``root``, :func:`weight_files`), checked against
    ``model`` from the files' headers when it is made (every name, shape, dtype and place in its file: ``ValueError``,
    nothing read), then delivered one at a time (:meth:`receive`), read with ``pread`` from the files opened at the
    check.  Not mapped: a file truncated under a mapping ends the process (``SIGBUS``), where a short read is an
    error.  A file whose size or modification time changed since the check (a trainer saving the next step in place)
    fails the transfer before its next tensor, and at its end: never committed as that check's.  Call :meth:`close`."""

    staged = False

    def __init__(self, model: Any, path: Path, root: Path | None = None) -> None:
        from ...integrations.manifest import entry, model_tensors

        own = model_tensors(model)
        # (file name, fd, its stat at the check, [(model's name, dtype, shape, offset, nbytes)])
        self._files: list[tuple[str, int, tuple, list[tuple[str, Any, tuple, int, int]]]] = []
        seen: set[str] = set()
        try:
            for file in weight_files(path, root):
                try:
                    fd = os.open(file, os.O_RDONLY)
                except OSError as error:
                    raise ValueError(f"{file.name}: cannot be read ({error})") from None
                tensors: list[tuple[str, Any, tuple, int, int]] = []
                self._files.append((file.name, fd, _stamp(fd), tensors))
                for name, dtype, shape, offset, nbytes in _header(file.name, fd):
                    try:
                        own_name = entry(own, name, shape, dtype).name
                    except ValueError as error:
                        raise ValueError(f"{file.name}: {error}") from None
                    if own_name in seen:
                        raise ValueError(f"{file.name}: {name!r}: its tensor is named twice in the files")
                    seen.add(own_name)
                    tensors.append((own_name, dtype, shape, offset, nbytes))
        except BaseException:
            self.close()
            raise
        self.total, self.names = len(seen), frozenset(seen)
        if not self.total:
            self.close()
            raise ValueError(f"the safetensors file(s) at {str(path)!r} hold no tensor")

    def receive(self, load: Any, progress: Any = None) -> None:
        """Each tensor to ``load(model's name, tensor)``; :class:`~cbpause.integrations.transfer.TransferFailed` if a
        file cannot be read, or changed since the check."""
        import torch

        from ...integrations.transfer import TransferFailed

        for file, fd, stamp, tensors in self._files:
            for name, dtype, shape, offset, nbytes in tensors:
                try:
                    data = os.pread(fd, nbytes, offset) if nbytes else b""
                    changed = _stamp(fd) != stamp
                except OSError as error:
                    raise TransferFailed(f"{file}: {name!r} cannot be read ({error})") from None
                if changed or len(data) != nbytes:
                    raise TransferFailed(f"{file} changed since it was checked (written again in place?): its "
                                         "tensors are not the ones checked")  # fmt: skip
                tensor = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)) if nbytes else \
                    torch.empty(0, dtype=getattr(torch, dtype))  # fmt: skip
                load(name, tensor.reshape(shape))
                if progress is not None:
                    progress()
            if _stamp(fd) != stamp:
                raise TransferFailed(f"{file} changed while it was read: its tensors are not the ones checked")

    def close(self) -> None:
        files, self._files = self._files, []
        for _, fd, _, _ in files:
            with contextlib.suppress(OSError):
                os.close(fd)


def _stamp(fd: int) -> tuple:
    st = os.fstat(fd)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _header(name: str, fd: int) -> list[tuple[str, str, tuple, int, int]]:
    """The tensors a safetensors file's header declares: ``(name, torch dtype name, shape, offset in the file,
    bytes)``, each checked against the file (its bytes where the header says, as many as its shape and dtype take);
    ``ValueError`` for a file that is not a safetensors file, or a dtype torch has not."""
    import torch

    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{name}: not a safetensors file (its header's length)")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{name}: not a safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: not a safetensors file (its header is not an object)")
    tensors = []
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(spec.get("dtype")) if isinstance(spec, dict) else None
        shape, offsets = (spec.get("shape"), spec.get("data_offsets")) if isinstance(spec, dict) else (None, None)
        if dtype is None or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"{name}: {key!r}: dtype {spec.get('dtype') if isinstance(spec, dict) else spec!r} is "
                             "not one torch has")  # fmt: skip
        if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                for n in shape)  # fmt: skip
                and isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
            raise ValueError(f"{name}: {key!r}: not a safetensors entry (its shape or offsets)")
        begin, end = offsets
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if not 0 <= begin <= end <= size - 8 - length or end - begin != nbytes:
            raise ValueError(f"{name}: {key!r}: its bytes are not where its header says, or not as many as its shape "
                             "and dtype take")  # fmt: skip
        tensors.append((key, dtype, tuple(shape), 8 + length + begin, nbytes))
    return tensors


def weight_info(model: Any) -> dict[str, Any]:
    """Every parameter's shape and dtype (what a trainer must write)."""
    return {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in model.state_dict().items()}  # fmt: skip
