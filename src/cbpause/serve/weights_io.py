"""Weights from disk: the safetensors files a trainer writes, checked whole before anything is copied (issue 29).

Decisions: the path must resolve (symbolic links followed) inside the server's ``--weights-dir``, so that an
HTTP client cannot make the server read an arbitrary file; it is one ``.safetensors`` file or a directory of them;
the tensors may be a subset of the model's parameters and buffers (a trainer may send only what it trained), but
every name must be one of the model's (wrappers' prefixes stripped as TRL's sync strips them), with its shape and
dtype.  Any mismatch is a ``ValueError`` and the model is left untouched: the copy starts only once every tensor
has been read and checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["check_inside", "load_checked", "copy_in", "weight_info"]


def check_inside(path: Any, root: Path | None) -> Path:
    """``path`` resolved; ``PermissionError`` when no weights directory was configured, ``ValueError`` when the path
    is not a string, lies outside ``root``, or does not exist."""
    if root is None:
        raise PermissionError("this server was started without --weights-dir: updates from disk are disabled")
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty string, not {path!r}")
    resolved = (root / path).resolve() if not Path(path).is_absolute() else Path(path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ValueError(f"path {path!r} is outside the weights directory {str(root)!r}")
    if not resolved.exists():
        raise ValueError(f"path {path!r} does not exist")
    return resolved


def load_checked(model: Any, path: Path) -> dict[str, Any]:
    """The tensors under ``path`` keyed by the model's own names, each checked against the model's tensor."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..integrations.weights import engine_name

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors file at {str(path)!r}")
    own = dict(model.state_dict(keep_vars=True))
    tensors: dict[str, Any] = {}
    for file in files:
        try:
            loaded = load_file(str(file), device="cpu")
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{file.name}: not a readable safetensors file ({error})") from None
        for name, tensor in loaded.items():
            target = own.get(engine_name(name))
            if target is None:
                raise ValueError(f"{file.name}: the model has no tensor {engine_name(name)!r} (written as {name!r})")
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise ValueError(f"{file.name}: tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}; the model's "
                                 f"is {tuple(target.shape)} {target.dtype}")  # fmt: skip
            tensors[engine_name(name)] = tensor
    if not tensors:
        raise ValueError(f"the safetensors file(s) at {str(path)!r} hold no tensor")
    return tensors


def copy_in(model: Any, tensors: dict[str, Any]) -> int:
    """Copy the checked tensors into the model, in place (the caller holds a pause); returns how many."""
    import torch

    own = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor.to(own[name].device))
    return len(tensors)


def weight_info(model: Any) -> dict[str, Any]:
    """Every parameter's shape and dtype (what a trainer must write)."""
    return {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in model.state_dict().items()}  # fmt: skip
