"""Weights from disk: the safetensors files a trainer writes, checked whole before anything is copied (issue 29).

Decisions: the path must resolve (symbolic links followed) inside the server's ``--weights-dir``, and so must each
file read from a directory, so that an HTTP client cannot make the server read an arbitrary file; only regular files
are read (a FIFO would block the reader); it is one ``.safetensors`` file or a directory of them;
the tensors may be a subset of the model's parameters and buffers (a trainer may send only what it trained), but
every name must be one of the model's (wrappers' prefixes stripped as TRL's sync strips them), with its shape and
dtype.  Any mismatch is a ``ValueError`` and the model is left untouched: the copy starts only once every tensor
has been read and checked.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

__all__ = ["CopyFailed", "ModelWriter", "check_inside", "copy_in", "copy_whole_or_shard", "load_checked", "weight_files",
           "weight_info"]


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


def load_checked(model: Any, path: Path, root: Path | None = None) -> dict[str, Any]:
    """The tensors under ``path`` keyed by the model's own names, each checked against the model's tensor
    (:func:`~cbpause.integrations.manifest.entry`): first every name and shape from the files' headers (nothing loaded
    yet), then each tensor's dtype once loaded.  Only the files :func:`weight_files` allows are opened."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from ..integrations.manifest import entry, model_tensors

    files = weight_files(path, root)
    own = model_tensors(model)
    tensors: dict[str, Any] = {}
    for file in files:  # the headers first: a file of the wrong model costs no read of its tensors
        try:
            with safe_open(str(file), framework="pt") as header:
                for name in header.keys():
                    entry(own, name, tuple(header.get_slice(name).get_shape()), None)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{file.name}: not a readable safetensors file ({error})") from None
        except ValueError as error:
            raise ValueError(f"{file.name}: {error}") from None
    for file in files:
        try:
            loaded = load_file(str(file), device="cpu")
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{file.name}: not a readable safetensors file ({error})") from None
        for name, tensor in loaded.items():
            try:
                tensors[entry(own, name, tuple(tensor.shape), tensor.dtype).name] = tensor
            except ValueError as error:
                raise ValueError(f"{file.name}: {error}") from None
    if not tensors:
        raise ValueError(f"the safetensors file(s) at {str(path)!r} hold no tensor")
    return tensors


class CopyFailed(RuntimeError):
    """The copy into the model stopped half-way (``copied`` tensors of ``total`` were copied): the weights are a
    mix, which the caller labels (``PartialSync``)."""

    def __init__(self, copied: int, total: int, why: str) -> None:
        super().__init__(f"the copy of the weights stopped after {copied} of {total} tensors: {why}")
        self.copied, self.total = copied, total


class ModelWriter:
    """Copies checked tensors into the model one at a time, in place (the caller holds a pause): what every transport
    hands its tensors to.  ``alive()`` is asked before each tensor, and the tensor copied, under ``lock`` (the lease
    table's ``copying``): once it says no (the write was cut at its deadline), nothing more is copied, and a tensor
    under way when the next write began lands before that write's own.  :meth:`load` raises :class:`CopyFailed`
    (``copied`` of ``total``) when it stops, for that or any other reason."""

    def __init__(self, model: Any, alive: Any = None, lock: Any = None, total: int | None = None) -> None:
        from ..integrations.manifest import model_tensors

        self._own = model_tensors(model)
        self._alive, self._lock, self.total = alive, lock, total
        self.copied = 0

    def load(self, name: str, tensor: Any) -> None:
        import contextlib

        import torch

        total = self.total if self.total is not None else self.copied + 1
        with torch.no_grad(), self._lock if self._lock is not None else contextlib.nullcontext():
            if self._alive is not None and not self._alive():
                raise CopyFailed(self.copied, total, "the write passed its deadline and was cut off")
            try:
                copy_whole_or_shard(self._own[name], tensor)
            except Exception as error:  # noqa: BLE001 -- reported with how far the copy went
                raise CopyFailed(self.copied, total, f"{type(error).__name__}: {error}") from error
        self.copied += 1


def copy_in(model: Any, tensors: dict[str, Any], alive: Any = None, lock: Any = None) -> int:
    """Copy the checked tensors into the model, in place (the caller holds a pause), through a :class:`ModelWriter`;
    returns how many.  :class:`CopyFailed` if it stops half-way."""
    writer = ModelWriter(model, alive, lock, total=len(tensors))
    for name, tensor in tensors.items():
        writer.load(name, tensor)
    return writer.copied


def copy_whole_or_shard(target: Any, tensor: Any) -> None:
    """Copy the whole tensor ``tensor`` into ``target``, in place: all of it, or, where ``target`` is a ``DTensor`` (a
    parameter of a tensor-parallel engine, whose shape is the whole tensor's), this rank's shard of it, cut by the
    target's own placements on this rank, with no collective (``src_data_rank=None``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        whole = tensor.to(target.to_local().device)
        target.to_local().copy_(distribute_tensor(whole, target.device_mesh, target.placements,
                                                  src_data_rank=None).to_local())  # fmt: skip
    else:
        target.copy_(tensor.to(target.device))


def weight_info(model: Any) -> dict[str, Any]:
    """Every parameter's shape and dtype (what a trainer must write)."""
    return {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in model.state_dict().items()}  # fmt: skip
