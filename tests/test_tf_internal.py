"""The one door to private TensorFlow/Keras APIs, and its version check."""

from __future__ import annotations

import ast
import collections
import ctypes
import itertools
import operator
import os
import pathlib
import re
import signal
import sys
import warnings

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import safevars
from safevars import _tf_internal
from tests.support import forked
from tests.support.deadlines import scaled

PACKAGE = pathlib.Path(safevars.__file__).parent  # installed or the source tree
PYPROJECT = next(  # the checkout's, also when the tests run against an installed wheel
    d / "pyproject.toml"
    for d in pathlib.Path(__file__).resolve().parents
    if (d / "pyproject.toml").exists()
)
PRIVATE = re.compile(r"^(tensorflow\.python|keras\.src)(\.|$)")


def _private_references(path: pathlib.Path) -> list[str]:
    """Imports of private modules, and strings naming them, in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if PRIVATE.match(n)]
    return found


def test_only_the_door_reaches_private_apis():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "_tf_internal.py":
            offenders += _private_references(path)
    assert offenders == []
    # The check itself sees what it is looking for.
    assert _private_references(PACKAGE / "_tf_internal.py")


def test_tested_versions_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tensorflow, keras in [
            ("2.21.0", "3.15.1"),
            ("2.21.3rc1", "3.15.0"),
            ("2.16.1", "3.12.0"),
            ("2.18.0", "3.13.2"),
        ]:
            assert _tf_internal.check_versions(tensorflow, keras) == ""


@pytest.mark.parametrize(
    ("tensorflow", "keras", "named"),
    [
        ("2.15.1", "3.15.1", ["TensorFlow 2.15.1"]),
        ("2.22.0rc0", "3.15.1", ["TensorFlow 2.22.0rc0"]),
        ("2.21.0", "3.16.0", ["Keras 3.16.0"]),
        ("2.16.2", "3.11.3", ["Keras 3.11.3"]),
        ("2.22.0rc0", "2.15.0", ["TensorFlow 2.22.0rc0", "Keras 2.15.0"]),
    ],
)
def test_untested_versions_warn_naming_them(tensorflow, keras, named):
    with pytest.warns(
        RuntimeWarning, match="tested with TensorFlow 2.16-2.21 and Keras 3.12-3.15"
    ):
        text = _tf_internal.check_versions(tensorflow, keras)
    for name in named:
        assert name in text
    assert "pip install 'tensorflow>=2.16,<2.22' 'keras>=3.12,<3.16'" in text


def test_installed_versions_are_the_declared_range():
    """pyproject.toml declares what the suite runs against; this run is one of them."""
    pyproject = tomllib.loads(PYPROJECT.read_text())["project"]
    for name, tested in [
        ("tensorflow", _tf_internal.TESTED_TENSORFLOW),
        ("keras", _tf_internal.TESTED_KERAS),
    ]:
        assert _tf_internal._pip_range(name, tested) in pyproject["dependencies"]
    (major, oldest), (_, newest) = _tf_internal.TESTED_PYTHON
    assert pyproject["requires-python"] == f">={major}.{oldest},<{major}.{newest + 1}"
    classifiers = pyproject["classifiers"]
    assert [c for c in classifiers if c.startswith("Programming Language :: Python :: 3.")] == [
        f"Programming Language :: Python :: {major}.{minor}" for minor in range(oldest, newest + 1)
    ]
    assert _tf_internal.check_versions() == ""
    assert _tf_internal.TESTED_PYTHON[0] <= sys.version_info[:2] <= _tf_internal.TESTED_PYTHON[1]


# ----------------------------------------------------------- call_each (Python 3.10)

CALL_EACH = {"chosen": _tf_internal.call_each, "by_partial": _tf_internal._call_each_by_partial}
_consume = collections.deque(maxlen=0).extend


class _Interrupted(Exception):
    pass


class _Box:
    a = b = value = 0


def test_call_each_is_operator_call_where_python_has_it():
    if sys.version_info >= (3, 11):
        assert _tf_internal.call_each.args == (operator.call,)
    else:
        assert _tf_internal.call_each is _tf_internal._call_each_by_partial


@pytest.mark.parametrize("name", sorted(CALL_EACH))
def test_call_each_calls_in_order(name):
    log: list[object] = []
    box = _Box()
    _consume(
        CALL_EACH[name](
            [(log.append, 1), (setattr, box, "value", 2), (log.extend, (3, 4)), (log.append, 5)]
        )
    )
    assert log == [1, 3, 4, 5]
    assert box.value == 2
    assert list(CALL_EACH[name]([(divmod, 7, 2), (max, 1, 9, 3)])) == [(3, 1), 9]


def _chain_under_interrupt(make_iterator):
    """Runs [raise SIGUSR1, write a, write b] through ``make_iterator`` and a C consumer;
    the handler raises. Returns (a, b) as the interrupt left them."""
    raise_signal_in_c = getattr(ctypes.CDLL(None), "raise")  # libc raise(): no check point
    box = _Box()

    def handler(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(_Interrupted):
            _consume(
                make_iterator(
                    [
                        (raise_signal_in_c, signal.SIGUSR1),
                        (setattr, box, "a", 1),
                        (setattr, box, "b", 1),
                    ]
                )
            )
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return box.a, box.b


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals")
@pytest.mark.parametrize("name", sorted(CALL_EACH))
def test_call_each_has_no_check_point_between_calls(name):
    """An interrupt raised by the first call lands after the last (Guard.write_counted:
    the write and its version count happen both or neither)."""
    assert _chain_under_interrupt(CALL_EACH[name]) == (1, 1)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals")
def test_the_interrupt_check_can_fail():
    """The same chain through a Python function lands the interrupt between the calls."""
    assert _chain_under_interrupt(
        lambda steps: itertools.starmap(lambda fn, *args: fn(*args), steps)
    ) == (0, 0)


_INTERRUPT_EVERY_POINT_OF_A_SCALAR_CONVERSION = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
import safevars

x = tf.constant(2.0)
y = x + 1.0

class At:  # KeyboardInterrupt at the k-th check point (function start, C call return)
    def __init__(self, k):
        self.k, self.seen, self.fired = k, 0, False

    def __call__(self, frame, event, arg):
        if event in ("call", "c_return"):
            if self.seen == self.k:
                sys.setprofile(None)
                self.fired = True
                raise KeyboardInterrupt
            self.seen += 1

k = 0
while True:
    at = At(k)
    sys.setprofile(at)
    try:
        y = x + 1.0  # converts the Python float: an EagerTensor made in C++
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
    if not at.fired:
        break
    k += 1
print(k, float(x + 1.0))
"""


def test_an_interrupt_at_every_check_point_of_an_eager_tensor_creation_is_survived():
    """A KeyboardInterrupt at each check point of ``x + 1.0`` (the float made an
    EagerTensor by TensorFlow's C++ constructor) propagates, and the process lives on.
    Without the C getter of the context's ``_handle`` the interrupt lands inside the
    constructor and TensorFlow crashes (SIGSEGV) at that point."""
    done = forked.run(
        ["-c", _INTERRUPT_EVERY_POINT_OF_A_SCALAR_CONVERSION],
        timeout=scaled(300),
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert done.returncode == 0, f"ended with {done.returncode}: {done.stderr[-3000:]}"
    points, value = done.stdout.split()
    assert int(points) > 20 and float(value) == 3.0
    assert not isinstance(_tf_internal.eager_context_module.Context._handle.fget, type(lambda: 0))


def test_keras_export_archive_is_the_class_that_tracks_endpoint_variables():
    """On every supported Keras, the archive ``keras.export.ExportArchive()`` makes is an
    instance of the class whose ``_filter_and_track_resources`` safevars patches."""
    import keras

    cls = _tf_internal.keras_export_archive()
    assert "_filter_and_track_resources" in vars(cls)
    assert isinstance(keras.export.ExportArchive(), cls)


# ------------------------------------------- a failed tf.function call frees its lock


def _other_thread_calls(function) -> bool:
    """Whether a call of ``function`` from another thread ends (within a bounded wait)."""
    import threading

    done = threading.Event()
    threading.Thread(target=lambda: (function(), done.set()), daemon=True).start()
    return done.wait(scaled(30))


def _counting_function():
    import tensorflow as tf

    v = tf.Variable(0.0)
    function = tf.function(lambda: v.assign_add(1.0), autograph=False)
    function()
    return v, function


def test_a_tf_function_called_with_wrong_arguments_stays_callable_from_other_threads():
    """TensorFlow's ``Function._call`` takes the function's lock, binds the arguments
    and releases it, with no ``finally``: without the workaround the ``TypeError`` of a
    bad call left the lock held and every other thread's call hung."""
    v, function = _counting_function()
    with pytest.raises(TypeError, match="Binding inputs"):
        function(1.0)
    assert _other_thread_calls(function), "another thread's call hung on the function's lock"
    assert float(v.numpy()) == 2.0


def test_an_exception_landing_after_a_tf_function_took_its_lock_frees_it():
    """An asynchronous exception (Ctrl-C, or ``test_faults``'s injected ones) landing on
    each line of ``Function._call`` after its ``acquire``, in turn: each one is raised
    to the caller, and the function stays callable from another thread."""
    import inspect

    v, function = _counting_function()
    original = type(function)._call
    assert getattr(original, "_safevars_releases_lock", False)
    code = original.__wrapped__.__code__
    lines, first = inspect.getsourcelines(code)
    acquire = first + next(i for i, line in enumerate(lines) if "_lock.acquire()" in line)
    released = first + next(i for i, line in enumerate(lines) if "_lock.release()" in line)

    class Landed(Exception):
        pass

    calls = 1
    for target in range(acquire + 1, released):

        def tracer(frame, event, arg, target=target):
            if frame.f_code is not code:
                return None

            def on_line(frame, event, arg):
                if event == "line" and frame.f_lineno == target:
                    raise Landed(target)
                return on_line

            return on_line

        sys.settrace(tracer)
        try:
            function()
            calls += 1  # (a line the call does not reach: nothing raised)
        except Landed:
            pass
        finally:
            sys.settrace(None)
        assert _other_thread_calls(function), f"hung after an exception at line {target}"
        calls += 1
    assert released - acquire > 2  # the binding happens in between
    assert float(v.numpy()) == calls
