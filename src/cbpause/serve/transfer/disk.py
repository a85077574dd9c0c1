"""Weights from disk, a transport (:mod:`cbpause.integrations.transfer`): the safetensors files a trainer writes,
checked whole from their headers before anything is read, then delivered tensor by tensor.

Decisions: the path must resolve (symbolic links followed) inside the server's ``--weights-dir``, and so must each
file read from a directory, so that an HTTP client cannot make the server read an arbitrary file; only regular files
are read (a FIFO would block the reader); it is one ``.safetensors`` file or a directory of them;
the tensors may be a subset of the model's parameters and buffers (a trainer may send only what it trained), but
every name must be one of the model's (wrappers' prefixes stripped as TRL's sync strips them), with its shape and
dtype.  Every name, shape and dtype is read from the files' headers and checked when the transport is made
(:class:`Disk`): any mismatch is a ``ValueError`` and the model is left untouched.  The tensors are then read one at a
time from the files mapped at that check, so a server holds one tensor of the update, not the update.
"""

from __future__ import annotations

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


class Disk:
    """The tensors under ``path`` (resolved; its files inside ``root``, :func:`weight_files`), checked against
    ``model`` from the files' headers when it is made (every name, shape and dtype: ``ValueError``, nothing read), then
    delivered one at a time from the files it opened then (:meth:`receive`).  Call :meth:`close` when done."""

    staged = False

    def __init__(self, model: Any, path: Path, root: Path | None = None) -> None:
        from safetensors import SafetensorError, safe_open

        from ...integrations.manifest import entry, model_tensors

        own = model_tensors(model)
        self._files: list[tuple[str, Any, list[tuple[str, str]]]] = []  # (file name, handle, (its name, model's))
        seen: set[str] = set()
        try:
            for file in weight_files(path, root):
                try:
                    handle = safe_open(str(file), framework="pt")
                except (SafetensorError, OSError) as error:
                    raise ValueError(f"{file.name}: not a readable safetensors file ({error})") from None
                names = []
                self._files.append((file.name, handle, names))
                for name in handle.keys():
                    tensor = handle.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype())
                    try:
                        own_name = entry(own, name, tuple(tensor.get_shape()), dtype).name
                    except ValueError as error:
                        raise ValueError(f"{file.name}: {error}") from None
                    if own_name in seen:
                        raise ValueError(f"{file.name}: {name!r}: its tensor is named twice in the files")
                    seen.add(own_name)
                    names.append((name, own_name))
        except BaseException:
            self.close()
            raise
        self.total, self.names = len(seen), frozenset(seen)
        if not self.total:
            self.close()
            raise ValueError(f"the safetensors file(s) at {str(path)!r} hold no tensor")

    def receive(self, load: Any, progress: Any = None) -> None:
        """Each tensor to ``load(model's name, tensor)``; :class:`~cbpause.integrations.transfer.TransferFailed` if a
        file cannot be read now."""
        from safetensors import SafetensorError

        from ...integrations.transfer import TransferFailed

        for file, handle, names in self._files:
            for name, own_name in names:
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError) as error:
                    raise TransferFailed(f"{file}: {name!r} cannot be read ({error})") from None
                load(own_name, tensor)
                if progress is not None:
                    progress()

    def close(self) -> None:
        files, self._files = self._files, []
        del files  # (safetensors' handles unmap their files when collected)


def weight_info(model: Any) -> dict[str, Any]:
    """Every parameter's shape and dtype (what a trainer must write)."""
    return {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in model.state_dict().items()}  # fmt: skip
