"""A protected model saved, copied or cloned comes back protected, with a lock of its own.

Keras writes a ``.keras`` file (``model.save``), a pickle (``pickle.dumps(model)``) and a
deep copy (``copy.deepcopy(model)``, through the same pickling) with one function,
``saving_lib._serialize_model_as_json``, and reads them back with
``_load_model_from_fileobj`` (a zip, a pickle, a copy) or ``_load_model_from_dir``. The
file's ``metadata.json`` of a protected model (:func:`safevars.is_protected`) gets a
``"safevars"`` entry; a file with it is loaded as if inside a
:func:`safevars.scope` block (the caller's block, if one is open; else a new one): the
model, its optimizer and its metrics are protected, under a lock of their own. Plain
Keras ignores the entry, and a file without it loads as it always did, plain, optimizer
included (a ``SafeOptimizer`` saved from an unprotected model comes back as such).

A loaded variable's version is 1: the file holds values, not versions, and the load
assigns each value once, through the lock (a variable the file does not hold, 0).
``tf.train.Checkpoint`` is the format that keeps versions.

``keras.models.clone_model`` of a protected model builds the clone the same way, so
the clone is protected too (fresh values, as ``clone_model`` always makes, versions 0).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from typing import Any

from safevars.creator_scope.creators import ScopeLocks, creating, current_block
from safevars.creator_scope.protection import is_protected

__all__ = ["cloning", "loading_from_dir", "loading_from_fileobj", "marking_metadata"]

_ENTRY = "safevars"  # metadata.json key
_METADATA = "metadata.json"


def marking_metadata(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``_serialize_model_as_json(model)``: metadata of a protected model is marked."""

    def serialize(model: Any, *args: Any, **kwargs: Any) -> Any:
        config_json, metadata_json = original(model, *args, **kwargs)
        if is_protected(model):
            metadata = json.loads(metadata_json)
            metadata[_ENTRY] = {"protected": True}
            metadata_json = json.dumps(metadata)
        return config_json, metadata_json

    serialize.__wrapped__ = original  # type: ignore[attr-defined]
    serialize._safevars = True  # type: ignore[attr-defined]
    return serialize


def _marked(metadata: bytes | str | None) -> bool:
    if not metadata:
        return False
    try:
        entry = json.loads(metadata).get(_ENTRY)
    except (ValueError, AttributeError):
        return False
    return isinstance(entry, dict) and entry.get("protected") is True


def _load_protected(load: Callable[[], Any]) -> Any:
    """``load()`` inside the caller's open block, or a new one."""
    if current_block() is not None:
        return load()
    with creating(ScopeLocks()):
        return load()


def _zip_metadata(fileobj: Any) -> bytes | None:
    try:
        with zipfile.ZipFile(fileobj, "r") as archive:  # leaves fileobj open
            return archive.read(_METADATA) if _METADATA in archive.namelist() else None
    except (zipfile.BadZipFile, OSError, ValueError):
        return None  # Keras' own load reports what is wrong with the file


def _dir_metadata(dirpath: Any) -> bytes | None:
    try:
        with open(os.path.join(str(dirpath), _METADATA), "rb") as f:
            return f.read()
    except OSError:
        return None


def _loading(
    original: Callable[..., Any], metadata_of: Callable[[Any], bytes | None]
) -> Callable[..., Any]:
    """Wraps a Keras loader whose first argument ``metadata_of`` reads the metadata of."""

    def load(source: Any, *args: Any, **kwargs: Any) -> Any:
        if not _marked(metadata_of(source)):
            return original(source, *args, **kwargs)
        return _load_protected(lambda: original(source, *args, **kwargs))

    load.__wrapped__ = original  # type: ignore[attr-defined]
    load._safevars = True  # type: ignore[attr-defined]
    return load


def loading_from_fileobj(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``_load_model_from_fileobj(fileobj, ...)`` (``.keras`` zips, pickles, copies)."""
    return _loading(original, _zip_metadata)


def loading_from_dir(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``_load_model_from_dir(dirpath, ...)`` (an unzipped ``.keras`` directory)."""
    return _loading(original, _dir_metadata)


def cloning(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``keras.models.clone_model``: the clone of a protected model is protected."""

    def clone_model(model: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_protected(model):
            return original(model, *args, **kwargs)
        return _load_protected(lambda: original(model, *args, **kwargs))

    clone_model.__wrapped__ = original  # type: ignore[attr-defined]
    clone_model.__doc__ = original.__doc__
    clone_model._safevars = True  # type: ignore[attr-defined]
    return clone_model
