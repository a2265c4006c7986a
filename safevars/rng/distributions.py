"""The distributions of a draw (normal, truncated normal, uniform, integers, seeds).

:class:`_Draws` builds every distribution on one method, ``_generate(kernels, shape)``
(:mod:`.kernels`), so a stream (:class:`~safevars.ReplicaStream`), a stream chosen
at run time (``_SelectedStream``) and the calling replica's stream
(:class:`~safevars.ReplicaRNG`, whose ``_generate`` selects the stream, then draws from
it) draw bitwise the same values for the same key and counter, with one set of
argument checks and one public signature per distribution.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from safevars._validation import check_int
from safevars.errors import InvalidArgumentError
from safevars.rng.arguments import _check_bounds, _float_dtype
from safevars.rng.kernels import (
    _FULL_INT,
    _NORMAL,
    _TRUNCATED_NORMAL,
    _UNIFORM,
    _UNIFORM_INT,
    _Kernels,
)


class _Draws:
    """The distributions, built on ``_generate``: shared by one stream
    (:class:`ReplicaStream`), a stream chosen at run time (:class:`_SelectedStream`) and
    the calling replica's stream (:class:`ReplicaRNG`), so all draw bitwise the same
    values for the same key and counter.

    Every public method checks its arguments, then calls ``_generate`` exactly once.
    """

    def _generate(self, kernels: _Kernels, shape: Any, **kwargs: Any) -> tf.Tensor:
        """Draws ``shape`` values with ``kernels`` and advances the stream's counter."""
        raise NotImplementedError

    def normal(
        self,
        shape: Any,
        mean: Any = 0.0,
        stddev: Any = 1.0,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws from a normal distribution.

        Args:
          shape: 1-D integer shape of the result (list, tuple, ``TensorShape`` or tensor).
          mean: Mean, broadcastable to ``shape``.
          stddev: Standard deviation, broadcastable to ``shape``.
          dtype: A floating-point dtype.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype``.

        Raises:
          InvalidArgumentError: ``dtype`` is not floating point; or, from a
            :class:`ReplicaRNG`, the calling replica has no stream (as
            :meth:`ReplicaRNG.current_stream`). Nothing is drawn.
          UnsupportedStrategyError: from a :class:`ReplicaRNG`: the current strategy is
            not supported, or is not the kind the RNG was created under
            (``ParameterServerStrategy`` or not); or an eager call on a
            ``ParameterServerStrategy`` coordinator. Nothing is drawn.

        Thread safety: the read and advance of the counter and the draw are one kernel
          under the state variable's mutex: concurrent draws never overlap. From a
          :class:`ReplicaRNG`, under ``MirroredStrategy`` every replica thread advances
          only its own stream; under ``ParameterServerStrategy`` concurrent workers
          advance their own counters on the parameter server.

        Modes: eagerly the draw runs at once; in a ``tf.function`` it runs each time the
          function runs (tracing draws nothing). Under ``tf.distribute``, a
          :class:`ReplicaStream` draws from itself whatever replica or worker calls it (a
          stream of :meth:`ReplicaRNG.for_worker` lives on a parameter server, reachable
          from the coordinator and every worker). A :class:`ReplicaRNG` draws from the
          calling replica's stream: inside ``strategy.run`` the replica comes from
          ``tf.distribute.get_replica_context()`` (a run-time replica id selects the
          stream with ``tf.switch_case``), elsewhere it is replica 0. Under
          ``ParameterServerStrategy`` it draws only in a ``tf.function`` run by
          ``ClusterCoordinator.schedule``: from the stream of the worker the coordinator
          runs the function on, bound at each call (the values are computed on that
          worker).
        """
        return self._standard_draw(_NORMAL, "normal", shape, mean, stddev, dtype, name)

    def truncated_normal(
        self,
        shape: Any,
        mean: Any = 0.0,
        stddev: Any = 1.0,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws from a normal distribution truncated to two standard deviations.

        Args:
          shape: 1-D integer shape of the result.
          mean: Mean, broadcastable to ``shape``.
          stddev: Standard deviation before truncation, broadcastable to ``shape``.
          dtype: A floating-point dtype.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype`` with values in ``mean ± 2·stddev``.

        Raises:
          InvalidArgumentError: ``dtype`` is not floating point, or as :meth:`normal`.
          UnsupportedStrategyError: as :meth:`normal`.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return self._standard_draw(
            _TRUNCATED_NORMAL, "truncated_normal", shape, mean, stddev, dtype, name
        )

    def _standard_draw(
        self,
        kernels: _Kernels,
        default_name: str,
        shape: Any,
        mean: Any,
        stddev: Any,
        dtype: Any,
        name: str | None,
    ) -> tf.Tensor:
        """A standard (normal or truncated normal) draw, then ``* stddev + mean``."""
        dtype = _float_dtype(dtype)
        with tf.name_scope(name or default_name):
            rnd = self._generate(kernels, shape, dtype=dtype)
            return _affine(rnd, stddev, mean, dtype)

    def uniform(
        self,
        shape: Any,
        minval: Any = 0,
        maxval: Any = None,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws from a uniform distribution on ``[minval, maxval)``.

        Args:
          shape: 1-D integer shape of the result.
          minval: Lower bound (included). For integer dtypes, ``minval`` and ``maxval``
            are both scalars or both ``None`` (the dtype's full range).
          maxval: Upper bound (excluded); default 1 for floating-point dtypes.
          dtype: Floating-point or integer dtype.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype``.

        Raises:
          InvalidArgumentError: an integer dtype with only one bound, a floating dtype
            with ``minval=None``, or Python bounds with ``minval >= maxval``; or as
            :meth:`normal`. Nothing is drawn.
          UnsupportedStrategyError: as :meth:`normal`.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        dtype = tf.as_dtype(dtype)
        if dtype.is_integer:
            if minval is None and maxval is None:
                return self._full_int(shape, dtype, name)
            if minval is None or maxval is None:
                raise InvalidArgumentError(
                    f"for integer dtype {dtype.name}, minval and maxval must both be given "
                    f"or both be None (full range); got minval={minval!r}, "
                    f"maxval={maxval!r}."
                )
            return self.uniform_int(shape, minval, maxval, dtype=dtype, name=name)
        dtype = _float_dtype(dtype)
        if minval is None:
            raise InvalidArgumentError(
                f"minval=None is only for integer dtypes (full range); for {dtype.name} "
                "pass a number (default 0)."
            )
        if maxval is None:
            maxval = 1
        _check_bounds(minval, maxval)
        with tf.name_scope(name or "uniform"):
            rnd = self._generate(_UNIFORM, shape, dtype=dtype)
            if _is_python_value(minval, 0) and _is_python_value(maxval, 1):
                return rnd
            lo = tf.convert_to_tensor(minval, dtype)
            return rnd * (tf.convert_to_tensor(maxval, dtype) - lo) + lo

    def uniform_int(
        self,
        shape: Any,
        minval: Any,
        maxval: Any,
        dtype: Any = tf.int64,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws integers uniformly from ``[minval, maxval)``.

        Args:
          shape: 1-D integer shape of the result.
          minval: Scalar lower bound (included).
          maxval: Scalar upper bound (excluded).
          dtype: ``tf.int32`` or ``tf.int64``.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype`` (slightly biased unless ``maxval - minval``
          is a power of two, as ``tf.random.Generator.uniform``).

        Raises:
          InvalidArgumentError: ``dtype`` is not int32/int64, or Python bounds with
            ``minval >= maxval``; or as :meth:`normal`. Nothing is drawn.
          UnsupportedStrategyError: as :meth:`normal`.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        dtype = tf.as_dtype(dtype)
        if dtype not in (tf.int32, tf.int64):
            raise InvalidArgumentError(
                f"dtype must be tf.int32 or tf.int64 for uniform_int, got {dtype.name}."
            )
        _check_bounds(minval, maxval)
        with tf.name_scope(name or "uniform_int"):
            return self._generate(
                _UNIFORM_INT,
                shape,
                minval=tf.convert_to_tensor(minval, dtype),
                maxval=tf.convert_to_tensor(maxval, dtype),
            )

    integers = uniform_int  # numpy.random.Generator's name.

    def _full_int(self, shape: Any, dtype: tf.DType, name: str | None) -> tf.Tensor:
        with tf.name_scope(name or "uniform_full_int"):
            return self._generate(_FULL_INT, shape, dtype=dtype)

    # -- seeds drawn from the stream -----------------------------------------------------

    def make_seeds(self, count: int = 1) -> tf.Tensor:
        """Draws ``count`` seeds for stateless ops (``tf.random.stateless_*``, ``tf.image``).

        Args:
          count: Number of seeds, ``>= 1``.

        Returns:
          An int64 tensor of shape ``[2, count]``; column ``i`` is one seed (the layout of
          ``tf.random.Generator.make_seeds``).

        Raises:
          InvalidArgumentError: ``count`` is not a positive int, or as :meth:`normal`.
            Nothing is drawn.
          UnsupportedStrategyError: as :meth:`normal`.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        count = check_int(count, "count", 1, fix="Ask for at least one seed.")
        return self._full_int([2, count], tf.int64, "make_seeds")

    def make_seed(self) -> tf.Tensor:
        """Draws one seed for a stateless op: an int64 tensor of shape ``[2]``.

        Raises:
          InvalidArgumentError: as :meth:`normal`.
          UnsupportedStrategyError: as :meth:`normal`.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return self._full_int([2], tf.int64, "make_seed")


def _is_python_value(value: Any, expected: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected


def _affine(rnd: tf.Tensor, scale: Any, shift: Any, dtype: tf.DType) -> tf.Tensor:
    """``rnd * scale + shift``, skipping the ops for the Python defaults 1 and 0."""
    if not _is_python_value(scale, 1):
        rnd = rnd * tf.convert_to_tensor(scale, dtype)
    if not _is_python_value(shift, 0):
        rnd = rnd + tf.convert_to_tensor(shift, dtype)
    return rnd
