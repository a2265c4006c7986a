"""The documented schema of ``results.json``, and a validator for it.

``SCHEMA`` is a JSON Schema (draft 2020-12 subset; every field carries a
``description``); ``python -m benchmarks --schema`` prints it. :func:`validate` checks a
document against it without third-party packages and returns the list of problems.

Units: every time is in seconds (``*_s``), per *call* of a variant unless named
``per_op_*`` (a call does ``ops_per_call`` units of work). ``ratio_to_baseline`` is the
variant's median divided by the baseline's median, in the same run (1.0 for the
baseline; above 1 is slower).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMA", "SCHEMA_VERSION", "validate"]

SCHEMA_VERSION = 1


def _num(description: str, minimum: float | None = 0) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number", "description": description}
    if minimum is not None:
        schema["minimum"] = minimum
    return schema


def _str(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def _obj(description: str, properties: dict[str, Any], optional: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "description": description,
        "properties": properties,
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
    }


_STATUS = {"enum": ["ok", "failed"], "description": "'failed' if anything in it raised."}
_ERROR = {
    "type": ["string", "null"],
    "description": "'ExceptionType: message' of the failure, or null.",
}
_TRACEBACK = {"type": ["string", "null"], "description": "Full traceback, or null."}

_GOAL = _obj(
    "A performance goal from the issue: variant's median over reference's median.",
    {
        "family": _str("Family name."),
        "case": _str("Case name."),
        "variant": _str("The variant the goal is about."),
        "reference": _str("The variant it is compared with (the baseline unless stated)."),
        "max_ratio": _num("The goal: the ratio must be at most this."),
        "ratio": {"type": ["number", "null"], "description": "Measured median ratio."},
        "met": {"type": ["boolean", "null"], "description": "ratio <= max_ratio."},
        "versus": {
            "type": "object",
            "description": "The variant's median over every other variant's median "
            "(e.g. against tf.CriticalSection), by variant name.",
        },
    },
)

_VARIANT = _obj(
    "One variant's measurements.",
    {
        "name": _str("Variant name, e.g. 'tf.Variable', 'SafeVariable'."),
        "baseline": {"type": "boolean", "description": "Whether this is the baseline."},
        "calls_per_batch": {
            "type": "integer", "minimum": 1, "description": "Calls timed per round."
        },
        "samples_s": {
            "type": "array",
            "items": _num("Seconds per call in one round."),
            "minItems": 1,
            "description": "Seconds per call, one sample per round, in round order.",
        },
        "median_s": _num("Median seconds per call."),
        "min_s": _num("Fastest round, seconds per call."),
        "max_s": _num("Slowest round, seconds per call."),
        "per_op_median_s": _num("median_s / ops_per_call."),
        "per_op_min_s": _num("min_s / ops_per_call."),
        "per_op_max_s": _num("max_s / ops_per_call."),
        "ops_per_s": _num("Throughput at the median: ops_per_call / median_s."),
        "ratio_to_baseline": {
            "type": ["number", "null"],
            "description": "median_s / the baseline's median_s (same run); null if that is 0.",
        },
        "extra": {
            "type": "object",
            "description": "Extra figures the variant returned in the last round "
            "(e.g. lost_updates).",
        },
        "extra_rounds": {
            "type": "array",
            "items": {"type": "object"},
            "description": "The extra figures of every round.",
        },
    },
)

_CASE = _obj(
    "One comparison: variants timed A/B interleaved, the first one the baseline.",
    {
        "name": _str("Case name, unique in its family, e.g. 'assign_add/scalar'."),
        "status": _STATUS,
        "error": _ERROR,
        "traceback": _TRACEBACK,
        "params": {"type": "object", "description": "Free-form parameters (size, threads)."},
        "ops_per_call": {"type": "integer", "minimum": 1, "description": "Work per call."},
        "baseline": {"type": ["string", "null"], "description": "Baseline variant name."},
        "duration_s": _num("Wall time spent on the case (warm-up included)."),
        "variants": {"type": "array", "items": _VARIANT, "description": "In case order."},
        "goal": {
            "anyOf": [{"type": "null"}, _GOAL],
            "description": "The case's performance goal, if it has one.",
        },
    },
)

_FAMILY = _obj(
    "One case family (one benchmarks/bench_<family>.py module).",
    {
        "name": _str("FAMILY of the module (what --cases selects)."),
        "description": _str("DESCRIPTION of the module."),
        "module": _str("Module name."),
        "default": {"type": "boolean", "description": "Runs without --cases."},
        "status": _STATUS,
        "error": _ERROR,
        "traceback": _TRACEBACK,
        "duration_s": _num("Wall time spent on the family."),
        "cases": {"type": "array", "items": _CASE, "description": "Measured cases."},
    },
)

_METADATA = _obj(
    "Where and when the figures were measured.",
    {
        "date_utc": _str("ISO 8601 UTC time the run started, e.g. 2026-01-31T12:00:00Z."),
        "mode": {"enum": ["quick", "full"], "description": "--quick or not."},
        "device": _obj(
            "The device the variables were placed on.",
            {
                "kind": {"enum": ["cpu", "gpu"], "description": "Device kind."},
                "name": _str("CPU or GPU model."),
                "tf_device": _str("TensorFlow device string, e.g. '/GPU:0'."),
                "details": {
                    "type": "object",
                    "description": "Extra facts (visible_gpus, compute_capability).",
                },
            },
        ),
        "tensorflow_version": _str("tf.__version__."),
        "python_version": _str("platform.python_version()."),
        "numpy_version": _str("numpy.__version__."),
        "safevars_version": _str("safevars.__version__, or 'unknown'."),
        "cpu_count": {"type": "integer", "minimum": 1, "description": "os.cpu_count()."},
        "platform": _str("platform.platform()."),
        "git_commit": _str("HEAD of the repository, or 'unknown'."),
        "git_dirty": {
            "type": ["boolean", "null"],
            "description": "Uncommitted changes in the work tree (null if unknown).",
        },
        "command": _str("The command line that produced the run."),
    },
)

_SETTINGS = _obj(
    "How the suite was run.",
    {
        "rounds": {"type": "integer", "minimum": 1, "description": "Rounds per case."},
        "warmup_time_s": _num("Warm-up seconds per variant."),
        "min_batch_time_s": _num("Target seconds per timed batch."),
        "sizes": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1},
            "description": "Element counts given to the families.",
        },
        "threads": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1},
            "description": "Thread counts given to the families.",
        },
        "families_selected": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Families run, in order.",
        },
    },
)

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "safevars benchmark results (results.json)",
    **_obj(
        "One run of python -m benchmarks.",
        {
            "schema_version": {"const": SCHEMA_VERSION, "description": "This schema."},
            "status": _STATUS,
            "metadata": _METADATA,
            "settings": _SETTINGS,
            "families": {"type": "array", "items": _FAMILY, "description": "In run order."},
            "goals": {
                "type": "array",
                "items": _GOAL,
                "description": "Every case goal of the run, with its outcome.",
            },
        },
    ),
}

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if name in ("number", "integer") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def _check(value: Any, schema: dict[str, Any], path: str, problems: list[str]) -> None:
    if "anyOf" in schema:
        if not any(not _errors(value, option, path) for option in schema["anyOf"]):
            problems.append(f"{path}: matches none of the allowed forms")
        return
    if "const" in schema and value != schema["const"]:
        problems.append(f"{path}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} not one of {schema['enum']}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, t) for t in types):
            problems.append(f"{path}: expected {' or '.join(types)}, got {type(value).__name__}")
            return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{path}: {value} < minimum {schema['minimum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}: missing {key!r}")
        for key, item in value.items():
            if key in properties:
                _check(item, properties[key], f"{path}.{key}", problems)
            elif schema.get("additionalProperties", True) is False:
                problems.append(f"{path}: unexpected key {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            problems.append(f"{path}: fewer than {schema['minItems']} items")
        if "items" in schema:
            for index, item in enumerate(value):
                _check(item, schema["items"], f"{path}[{index}]", problems)


def _errors(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    problems: list[str] = []
    _check(value, schema, path, problems)
    return problems


def validate(document: Any, schema: dict[str, Any] = SCHEMA) -> list[str]:
    """Problems found checking ``document`` against ``schema`` (empty: valid)."""
    return _errors(document, schema, "$")
