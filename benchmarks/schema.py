"""The documented schema of ``results.json``, and a validator for it.

``SCHEMA`` is a JSON Schema (draft 2020-12 subset; every field carries a
``description``); ``python -m benchmarks --schema`` prints it. :func:`validate` checks a
document against it without third-party packages and returns the list of problems.

Units: every time is in seconds (``*_s``), per *call* of a variant unless named
``per_op_*`` (a call does ``ops_per_call`` units of work). ``ratio_to_baseline`` is the
variant's median divided by the baseline's median, in the same run (1.0 for the
baseline; above 1 is slower).

Every ratio has a 95% confidence interval beside it (``*_ci_95``: ``[low, high]``, or
null with fewer than ``settings.confidence_interval.min_rounds`` rounds): a paired
bootstrap of the ratio of medians over the rounds (in two stages when ``--repeat``
pooled several: repetitions, then rounds within each; see :mod:`benchmarks.timing`). A
goal's ``verdict`` is "met" when the interval lies entirely on the right side of the
bound, "missed" when it lies entirely on the wrong side, else "inconclusive" ("not
measured" without a ratio).

A run writes the document after every case, not only at its end: ``complete`` is false
until every selected family ran, and ``interrupted_by`` names the signal (``"SIGINT"``,
``"SIGTERM"``) that stopped a run; a run that was killed (SIGKILL, a crash) leaves its
last document, ``complete`` false and ``interrupted_by`` null, as does a run still
going. ``settings.families_selected`` lists every family asked for, ``families`` those
that started, each with the cases that finished. ``python -m benchmarks --resume DIR``
finishes such a run and records itself in ``resumed``.

Version 2 (this one) added the intervals, ``verdict``, ``operator``/``bound`` (goals of
the form ">= x"), ``settings.repeat`` and the per-repetition round counts; ``met`` is
now true/false only for a met/missed verdict (null when inconclusive). Later additions
are optional, so documents written before them stay valid: ``ratio_per_repetition`` of a
goal, ``plot_against`` of a family; ``complete``, ``interrupted_by`` and ``resumed`` of
the document (a document without ``complete`` is a complete run: earlier versions wrote
only at the end), ``phases_s`` and ``memory_mb`` of a case.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMA", "SCHEMA_VERSION", "validate"]

SCHEMA_VERSION = 2


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


def _ci(description: str) -> dict[str, Any]:
    return {
        "anyOf": [
            {"type": "null"},
            {"type": "array", "items": _num("Ratio.", None), "minItems": 2, "maxItems": 2},
        ],
        "description": description + " 95% confidence interval [low, high] (paired "
        "bootstrap of the ratio of medians), or null with too few rounds.",
    }


_COUNTS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0},
    "minItems": 1,
    "description": "One entry per repetition (--repeat), in order.",
}

_GOAL = _obj(
    "A performance goal from the issue: variant's median over reference's median.",
    {
        "family": _str("Family name."),
        "case": _str("Case name."),
        "variant": _str("The variant the goal is about."),
        "reference": _str("The variant it is compared with (the baseline unless stated)."),
        "operator": {
            "enum": ["<=", ">="],
            "description": "'<=': the ratio must be at most bound; '>=': at least bound.",
        },
        "bound": _num("The goal's bound on the ratio."),
        "max_ratio": {
            "type": ["number", "null"],
            "description": "bound for '<=' goals, null for '>=' goals (kept from version 1).",
        },
        "ratio": {"type": ["number", "null"], "description": "Measured median ratio."},
        "ratio_ci_95": _ci("The ratio's"),
        "ratio_per_repetition": {
            "type": "array",
            "items": {"type": ["number", "null"]},
            "description": "The ratio within each repetition, in order (one value "
            "without --repeat; empty when the rounds are not paired). How far they spread "
            "is what the pooled interval's first stage resamples.",
        },
        "verdict": {
            "enum": ["met", "missed", "inconclusive", "not measured"],
            "description": "'<=' goals: met when the interval's upper end <= bound, missed "
            "when its lower end > bound; '>=' goals the mirror image; inconclusive "
            "otherwise (or without an interval).",
        },
        "met": {
            "type": ["boolean", "null"],
            "description": "true when met, false when missed, null otherwise.",
        },
        "rounds": {
            "type": "integer",
            "minimum": 0,
            "description": "Paired rounds behind the ratio (all repetitions).",
        },
        "versus": {
            "type": "object",
            "description": "The variant's median over every other variant's median "
            "(e.g. against tf.CriticalSection), by variant name.",
        },
        "versus_ci_95": {
            "type": "object",
            "additionalProperties": _ci("Each versus ratio's"),
            "description": "The 95% confidence interval of each versus ratio, by name.",
        },
    },
    optional=("ratio_per_repetition",),  # added after version 2 was released
)

_VARIANT = _obj(
    "One variant's measurements.",
    {
        "name": _str("Variant name, e.g. 'tf.Variable', 'SafeVariable'."),
        "baseline": {"type": "boolean", "description": "Whether this is the baseline."},
        "calls_per_batch": {
            "type": "integer",
            "minimum": 1,
            "description": "Calls timed per round (first repetition).",
        },
        "calls_per_batch_repetitions": {
            **_COUNTS,
            "description": "Calls timed per round, in each repetition.",
        },
        "rounds": {"type": "integer", "minimum": 1, "description": "len(samples_s)."},
        "rounds_per_repetition": {
            **_COUNTS,
            "description": "Rounds each repetition contributed to samples_s.",
        },
        "samples_s": {
            "type": "array",
            "items": _num("Seconds per call in one round."),
            "minItems": 1,
            "description": "Seconds per call, one sample per round, in round order "
            "(repetitions one after another).",
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
        "ratio_to_baseline_ci_95": _ci("ratio_to_baseline's ([1, 1] for the baseline)."),
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
        "repetitions": {
            "type": "integer",
            "minimum": 0,
            "description": "Repetitions pooled in the samples (0 if the case failed).",
        },
        "duration_s": _num("Wall time spent on the case (warm-up included, all repetitions)."),
        "variants": {"type": "array", "items": _VARIANT, "description": "In case order."},
        "goal": {
            "anyOf": [{"type": "null"}, _GOAL],
            "description": "The case's performance goal, if it has one.",
        },
        "phases_s": {
            "type": "object",
            "additionalProperties": _num("Seconds."),
            "description": "Where the case's wall time went, all repetitions: 'build' "
            "(building the case: models, variables, pipelines), 'first_call' (each "
            "variant's first call: tracing), 'warmup' (the rest of the warm-up and "
            "calibration), 'rounds' (the timed rounds), 'release' (freeing memory after "
            "it). Empty for a case recorded before this field existed.",
        },
        "memory_mb": {
            "type": "object",
            "additionalProperties": _num("Megabytes (10^6 bytes)."),
            "description": "The process's memory once the case was measured and released: "
            "'rss' (resident now) and 'peak' (the highest resident memory of the process "
            "so far). Empty where the platform does not tell (Linux does).",
        },
    },
    optional=("phases_s", "memory_mb"),  # added after version 2 was released
)

_FAMILY = _obj(
    "One case family (one benchmarks/bench_<family>.py module).",
    {
        "name": _str("FAMILY of the module (what --cases selects)."),
        "description": _str("DESCRIPTION of the module."),
        "module": _str("Module name."),
        "default": {"type": "boolean", "description": "Runs without --cases."},
        "plot_against": {
            "type": ["string", "null"],
            "description": "PLOT_AGAINST of the module: the numeric case parameter its "
            "ratios are plotted against (<family>_vs_<param>.png), or null.",
        },
        "status": _STATUS,
        "error": _ERROR,
        "traceback": _TRACEBACK,
        "duration_s": _num("Wall time spent on the family."),
        "cases": {"type": "array", "items": _CASE, "description": "Measured cases."},
    },
    optional=("plot_against",),  # added after version 2 was released
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
        "rounds": {
            "type": "integer",
            "minimum": 1,
            "description": "Rounds per case in each repetition.",
        },
        "repeat": {
            "type": "integer",
            "minimum": 1,
            "description": "--repeat: passes over the selected families, rounds pooled.",
        },
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
        "confidence_interval": _obj(
            "How every ratio's interval was computed.",
            {
                "level": _num("Coverage, 0.95."),
                "method": _str("The method, in words."),
                "resamples": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Bootstrap resamples.",
                },
                "seed": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Seed of the resampling.",
                },
                "min_rounds": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "Fewer paired rounds give no interval.",
                },
            },
        ),
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
            "complete": {
                "type": "boolean",
                "description": "true when every selected family ran to its end; false in "
                "the document a run writes after every case, which is what an interrupted "
                "or killed run leaves (absent in documents from before: complete).",
            },
            "interrupted_by": {
                "type": ["string", "null"],
                "description": "'SIGINT' (Ctrl-C) or 'SIGTERM' when such a signal stopped "
                "the run; null otherwise (a complete run, one still going, or one killed "
                "without a chance to say so).",
            },
            "resumed": {
                "type": "array",
                "items": _obj(
                    "One --resume that continued the run.",
                    {
                        "date_utc": _str("ISO 8601 UTC time the resumed run started."),
                        "command": _str("Its command line."),
                    },
                ),
                "description": "Each python -m benchmarks --resume DIR that continued this "
                "run, in order (empty when it ran in one go).",
            },
            "metadata": _METADATA,
            "settings": _SETTINGS,
            "families": {"type": "array", "items": _FAMILY, "description": "In run order."},
            "goals": {
                "type": "array",
                "items": _GOAL,
                "description": "Every case goal of the run, with its outcome.",
            },
        },
        optional=("complete", "interrupted_by", "resumed"),  # added after version 2
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
        extra = schema.get("additionalProperties", True)
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}: missing {key!r}")
        for key, item in value.items():
            if key in properties:
                _check(item, properties[key], f"{path}.{key}", problems)
            elif extra is False:
                problems.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _check(item, extra, f"{path}.{key}", problems)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            problems.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(f"{path}: more than {schema['maxItems']} items")
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
