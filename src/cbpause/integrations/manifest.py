"""Whether a tensor a trainer sends fits the engine's model: the one check every way weights arrive shares.

A weight update names tensors as the trainer's model names them; each must be one of the engine's parameters or
buffers (the wrappers' prefixes stripped: :func:`~.weights.engine_name`), named once, with the engine's shape and
dtype.  The in-process sync (TRL's ``send_weights``), the files read from disk (their headers, then each tensor
loaded) and a broadcast's manifest (before the first byte) all ask :func:`entry`, so that they cannot drift apart: a
refusal names the tensor and what differs, the same words whichever way it came.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .weights import engine_name

__all__ = ["Entry", "NoSuchTensor", "check_manifest", "dtype_of", "entry", "model_tensors"]


class NoSuchTensor(ValueError, KeyError):
    """The model has no tensor of that name: a ``ValueError`` (a refused update) that is also the ``KeyError`` a lookup
    raises, as the in-process sync documents."""

    def __str__(self) -> str:
        return str(self.args[0])


class Entry(NamedTuple):
    """One tensor of an update: the model's own name for it, its shape and its torch dtype (a tuple: the client's
    wire code, which imports nothing of cbpause, unpacks it)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any


def model_tensors(model: Any) -> dict[str, Any]:
    """The model's parameters and buffers by name, the tensors an update may write."""
    return dict(model.state_dict(keep_vars=True))


def dtype_of(name: Any) -> Any:
    """The torch dtype a manifest names as ``weight_info`` writes it (``"float32"``, ``"bfloat16"``), or
    ``ValueError``."""
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (as /weight_info names them: 'float32', 'bfloat16', ...)")
    return dtype


def entry(own: dict[str, Any], name: Any, shape: Any, dtype: Any) -> Entry:
    """The entry of the tensor the trainer calls ``name``, of ``shape`` and ``dtype`` (a torch dtype, its name, or
    ``None`` where it is not known yet: a file's header), checked against the model's tensors ``own``
    (:func:`model_tensors`): :class:`NoSuchTensor` for a name the model lacks, ``ValueError`` for a shape or dtype that
    differs from the model's."""
    target = own.get(engine_name(name)) if isinstance(name, str) else None
    if target is None:
        written = f" (sent as {name!r})" if isinstance(name, str) and engine_name(name) != name else ""
        shown = engine_name(name) if isinstance(name, str) else name
        raise NoSuchTensor(f"the model has no tensor {shown!r}{written}")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        raise ValueError(f"{name!r}: shape {shape!r} is not a list of integers")
    torch_dtype = target.dtype if dtype is None else dtype_of(dtype) if isinstance(dtype, str) else dtype
    if tuple(shape) != tuple(target.shape) or torch_dtype != target.dtype:
        raise ValueError(f"{name!r} is {tuple(shape)} {_dtype_name(torch_dtype)}; the model's is "
                         f"{tuple(target.shape)} {_dtype_name(target.dtype)}")  # fmt: skip
    return Entry(engine_name(name), tuple(shape), target.dtype)


def check_manifest(model: Any, names: Any, dtypes: Any, shapes: Any) -> list[Entry]:
    """An update's tensors in the order they will be sent, each checked by :func:`entry` and named once; a
    ``ValueError`` naming every tensor refused (eight at most), before anything is received."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must be as long as each other, and not empty: {len(names)}, "
                         f"{len(dtypes)}, {len(shapes)}")  # fmt: skip
    own = model_tensors(model)
    refused, manifest, seen = [], [], set()
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if isinstance(name, str) and engine_name(name) in seen:
            refused.append(f"{name!r}: its tensor is named twice")
            continue
        seen.add(engine_name(name) if isinstance(name, str) else None)
        try:
            if not isinstance(dtype, str):
                raise ValueError(f"{name!r}: dtype {dtype!r} is not a name ('float32', 'bfloat16', ...)"[:200])
            manifest.append(entry(own, name, shape, dtype))
        except ValueError as error:
            refused.append(str(error)[:300])
    if refused:
        raise ValueError(f"refused before any transfer: {'; '.join(refused[:8])}"
                         + (f"; and {len(refused) - 8} more" if len(refused) > 8 else ""))  # fmt: skip
    return manifest


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
