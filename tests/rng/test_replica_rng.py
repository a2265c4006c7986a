"""ReplicaRNG: reproducibility, per-replica streams, statistics, threads, checkpoints, bad input."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from safevars.errors import InvalidArgumentError, SafeVarsError
from safevars.rng import ReplicaRNG, ReplicaStream
from tests.support import forked
from tests.support.deadlines import scaled
from tests.support.threading_harness import run_threads

SUBPROCESS_TIMEOUT = 300
# The directory that holds tests/ (a subprocess imports this module as tests.rng....).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def draws(stream_or_rng):
    """A fixed sequence of every kind of draw, as numpy arrays."""
    s = stream_or_rng
    return [
        s.normal([5]),
        s.normal([2, 3], mean=1.0, stddev=2.0, dtype=tf.float64),
        s.truncated_normal([7]),
        s.uniform([4]),
        s.uniform([3], minval=-2.0, maxval=5.0),
        s.uniform_int([6], 0, 100),
        s.integers([2], -5, 5, dtype=tf.int32),
        s.uniform([3], minval=None, maxval=None, dtype=tf.int64),
        s.make_seeds(3),
        s.make_seed(),
        s.normal([]),
    ]


def as_bytes(tensors):
    return [np.asarray(t).tobytes() for t in tensors]


def state_of(rng):
    return [s.state.numpy().tolist() for s in rng.streams]


class TestReproducibility:
    def test_same_seed_same_streams_in_a_new_instance(self, mode):
        a, b = ReplicaRNG(2024, num_replicas=3), ReplicaRNG(2024, num_replicas=3)
        for r in range(3):
            got_a = mode(lambda: draws(a.for_replica(r)))()
            got_b = mode(lambda: draws(b.for_replica(r)))()
            assert as_bytes(got_a) == as_bytes(got_b)
        assert state_of(a) == state_of(b)

    def test_eager_and_graph_draws_are_bitwise_equal(self):
        eager, graph = ReplicaRNG(606), ReplicaRNG(606)
        dynamic = tf.function(
            lambda shape: graph.normal(shape),
            input_signature=[tf.TensorSpec([None], tf.int32)],
            autograph=False,
        )
        for _ in range(2):
            assert as_bytes(draws(eager)) == as_bytes(tf.function(lambda: draws(graph))())
            assert state_of(eager) == state_of(graph)
            # Large static draws in a graph take the split (skip + stateless) path.
            big = tf.function(
                lambda: [
                    graph.normal([300, 300]),
                    graph.uniform_int([70_000], 0, 9),
                    graph.truncated_normal([256, 256]),
                ]
            )()
            want = [
                eager.normal([300, 300]),
                eager.uniform_int([70_000], 0, 9),
                eager.truncated_normal([256, 256]),
            ]
            assert as_bytes(big) == as_bytes(want)
            assert state_of(eager) == state_of(graph)
            for shape in ([0], [5, 3], [1], [300, 300]):
                np.testing.assert_array_equal(
                    dynamic(tf.constant(shape)).numpy(), eager.normal(shape).numpy()
                )
                assert state_of(eager) == state_of(graph)

    def test_graph_draws_from_4096_elements_fill_outside_the_state_lock(self):
        """A graph draw of at least 4,096 elements takes the split form (RngReadAndSkip,
        then the stateless kernel, so that draws of one stream fill in parallel); a
        smaller one is one op, the fused stateful kernel (issue 44: at 1,000 elements
        the split form's three more ops per draw cost 1.2x stateless_normal). Both give
        the eager values (above)."""
        rng = ReplicaRNG(808)

        def op_types(size):
            fn = tf.function(lambda: rng.normal([size]), autograph=False)
            return [op.type for op in fn.get_concrete_function().graph.get_operations()]

        def work(types):  # what a draw runs, besides its inputs and outputs
            return [t for t in types if t not in {"Placeholder", "Const", "Identity", "NoOp"}]

        small, large = op_types(4095), op_types(4096)
        assert work(small) == work(op_types(1000)) == ["StatefulStandardNormalV2"], small
        assert {"RngReadAndSkip", "Bitcast", "StatelessRandomNormalV2"} <= set(large)
        assert "StatefulStandardNormalV2" not in large

    def test_a_draw_is_philox_of_key_and_counter(self):
        # The documented semantics: a draw equals RngReadAndSkip(number of elements)
        # followed by the stateless kernel on the fetched [counter, key].
        from tensorflow.python.ops import gen_stateful_random_ops as stateful
        from tensorflow.python.ops import gen_stateless_random_ops_v2 as stateless

        rng = ReplicaRNG(707)
        stream = rng.for_replica(0)
        twin = tf.Variable(stream.state.read_value())

        def split_draw(shape, kernel, **kwargs):
            n = int(np.prod(shape))
            state = stateful.rng_read_and_skip(twin.handle, 1, tf.constant(n, tf.uint64))
            counter, key = tf.split(tf.bitcast(state, tf.uint64), [2, 1])
            return kernel(shape, key=key, counter=counter, alg=1, **kwargs).numpy()

        for shape in ([3], [2, 5], [1000]):
            np.testing.assert_array_equal(
                stream.normal(shape).numpy(),
                split_draw(shape, stateless.stateless_random_normal_v2),
            )
            np.testing.assert_array_equal(
                stream.uniform(shape, dtype=tf.float64).numpy(),
                split_draw(shape, stateless.stateless_random_uniform_v2, dtype=tf.float64),
            )
            np.testing.assert_array_equal(
                stream.truncated_normal(shape).numpy(),
                split_draw(shape, stateless.stateless_truncated_normal_v2),
            )
            np.testing.assert_array_equal(
                stream.uniform_int(shape, 0, 9).numpy(),
                split_draw(
                    shape,
                    stateless.stateless_random_uniform_int_v2,
                    minval=tf.constant(0, tf.int64),
                    maxval=tf.constant(9, tf.int64),
                ),
            )
            assert stream.state.numpy().tolist() == twin.numpy().tolist()

    def test_different_seeds_replicas_and_workers_differ(self):
        base = ReplicaRNG(7, num_replicas=2)
        others = [
            base.for_replica(1),
            ReplicaRNG(8, num_replicas=2).for_replica(0),
            ReplicaRNG(7, num_replicas=2, worker=("worker", 1)).for_replica(0),
            ReplicaRNG(7, num_replicas=2, worker=("chief", 0)).for_replica(0),
        ]
        first = base.for_replica(0).uniform_int([16], 0, 2**31 - 1).numpy()
        keys = {base.for_replica(0).key}
        for stream in others:
            assert stream.key not in keys
            keys.add(stream.key)
            assert not np.array_equal(stream.uniform_int([16], 0, 2**31 - 1).numpy(), first)

    def test_derivation_is_pinned(self):
        # The derivation is part of the contract: these values must never change.
        rng = ReplicaRNG(1234, num_replicas=2)
        assert [s.key for s in rng.streams] == [0x26AB36C2BDC12A3D, 0x998C310AC9A064DF]
        assert rng.for_replica(0).state.numpy().tolist() == [0, 0, 0x26AB36C2BDC12A3D]
        assert rng.seed_for("dropout") == 728897668
        assert rng.dataset_seed(1) == 3355138032692940385
        assert rng.element_seed(5).numpy().tolist() == [562604237234773123, 5]
        expected = np.random.Generator(
            np.random.PCG64(
                np.random.SeedSequence(
                    1234,
                    spawn_key=(
                        1,
                        int.from_bytes(
                            __import__("hashlib").sha256(b"worker").digest()[:8], "little"
                        ),
                        0,
                        1,
                        0,
                    ),
                )
            )
        ).integers(0, 2**62, size=4)
        np.testing.assert_array_equal(rng.numpy(1).integers(0, 2**62, size=4), expected)

    def test_same_streams_in_a_new_process(self):
        script = textwrap.dedent("""
            import os, sys
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
            os.environ.pop("TF_CONFIG", None)
            sys.path.insert(0, sys.argv[1])
            import tensorflow as tf
            from tests.rng.test_replica_rng import draws, as_bytes
            from safevars.rng import ReplicaRNG
            rng = ReplicaRNG(99, num_replicas=2)
            out = []
            for r in range(2):
                out += [b.hex() for b in as_bytes(draws(rng.for_replica(r)))]
            out.append(str(rng.seed_for("a", 1)))
            out.append(rng.numpy(1, epoch=2).random(3).tobytes().hex())
            print("\\n".join(out))
        """)
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        proc = forked.run(["-c", script, REPO], timeout=scaled(SUBPROCESS_TIMEOUT), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rng = ReplicaRNG(99, num_replicas=2, worker=("worker", 0))
        expected = []
        for r in range(2):
            expected += [b.hex() for b in as_bytes(draws(rng.for_replica(r)))]
        expected.append(str(rng.seed_for("a", 1)))
        expected.append(rng.numpy(1, epoch=2).random(3).tobytes().hex())
        assert proc.stdout.split() == expected


class TestStrategies:
    def test_each_replica_draws_its_own_stream(self, mirrored_strategy, mode):
        rng = ReplicaRNG(5, num_replicas=2)
        reference = ReplicaRNG(5, num_replicas=2)

        def step():
            return mirrored_strategy.run(
                lambda: (rng.normal([4]), rng.uniform_int([4], 0, 1000), rng.make_seed())
            )

        results = mode(step)()
        per_replica = [
            [t.numpy() for t in mirrored_strategy.experimental_local_results(part)]
            for part in results
        ]
        for r in range(2):
            stream = reference.for_replica(r)
            expected = [stream.normal([4]), stream.uniform_int([4], 0, 1000), stream.make_seed()]
            for got, want in zip([p[r] for p in per_replica], expected):
                np.testing.assert_array_equal(got, want.numpy())
        assert not np.array_equal(per_replica[0][0], per_replica[0][1])
        assert state_of(rng) == state_of(reference)

    def test_created_in_scope_one_stream_per_replica_device(self, mirrored_strategy):
        with mirrored_strategy.scope():
            rng = ReplicaRNG(3)
            seed = rng.seed_for("x")  # Cross-replica context: replica 0.
            rng.normal([2])
        assert rng.num_replicas == 2
        devices = [tf.DeviceSpec.from_string(s.state.device) for s in rng.streams]
        assert [(d.device_type, d.device_index) for d in devices] == [("CPU", 0), ("CPU", 1)]
        assert all(type(s.state).__name__ == "ResourceVariable" for s in rng.streams)
        assert seed == ReplicaRNG(3, num_replicas=2).seed_for("x", replica_id=0)
        assert rng.for_replica(1).state.numpy()[:2].tolist() == [0, 0]
        assert rng.for_replica(0).state.numpy()[:2].tolist() != [0, 0]

    def test_pure_seeds_follow_the_replica_context(self, mirrored_strategy):
        rng = ReplicaRNG(11, num_replicas=2)
        got = mirrored_strategy.run(lambda: tf.constant(rng.seed_for("aug")))
        got = [int(t) for t in mirrored_strategy.experimental_local_results(got)]
        assert got == [rng.seed_for("aug", replica_id=r) for r in range(2)]
        assert got[0] != got[1]

    def test_too_few_streams_for_the_strategy_is_an_error(self, mirrored_strategy, mode):
        rng = ReplicaRNG(5, num_replicas=1)
        before = state_of(rng)
        with pytest.raises(InvalidArgumentError, match="num_replicas"):
            mode(lambda: mirrored_strategy.run(lambda: rng.normal([2])))()
        assert state_of(rng) == before

    def test_replica_id_known_only_at_run_time(self):
        rng = ReplicaRNG(17, num_replicas=3)
        reference = ReplicaRNG(17, num_replicas=3)

        @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
        def draw(replica):
            rng._current_replica = lambda: replica  # What TPUStrategy's context gives.
            try:
                return rng.normal([3])
            finally:
                del rng._current_replica

        for r in [2, 0, 2, 1]:
            np.testing.assert_array_equal(
                draw(tf.constant(r)).numpy(), reference.for_replica(r).normal([3]).numpy()
            )
        assert state_of(rng) == state_of(reference)

    def test_worker_from_tf_config_and_argument(self, monkeypatch):
        monkeypatch.setenv(
            "TF_CONFIG",
            json.dumps(
                {
                    "cluster": {"worker": ["localhost:1", "localhost:2"]},
                    "task": {"type": "worker", "index": 1},
                }
            ),
        )
        from_env = ReplicaRNG(1)
        assert from_env.worker == ("worker", 1)
        assert from_env.for_replica(0).key == ReplicaRNG(1, worker=("worker", 1)).streams[0].key
        monkeypatch.delenv("TF_CONFIG")
        assert ReplicaRNG(1).worker == ("worker", 0)
        assert ReplicaRNG(1).streams[0].key != from_env.streams[0].key


class TestStatistics:
    N = 20_000

    def _corr(self, a, b):
        return abs(float(np.corrcoef(np.asarray(a), np.asarray(b))[0, 1]))

    def test_replicas_workers_and_seeds_are_uncorrelated(self, mirrored_strategy):
        rng = ReplicaRNG(42, num_replicas=2)
        per_replica = mirrored_strategy.experimental_local_results(
            mirrored_strategy.run(lambda: rng.normal([self.N]))
        )
        assert self._corr(*per_replica) < 0.02

        wide = ReplicaRNG(42, num_replicas=4)
        samples = [s.normal([self.N]) for s in wide.streams]
        for i in range(4):
            for j in range(i + 1, 4):
                assert self._corr(samples[i], samples[j]) < 0.02, (i, j)
        other_worker = ReplicaRNG(42, worker=("worker", 1)).normal([self.N])
        assert self._corr(samples[0], other_worker) < 0.02
        other_seed = ReplicaRNG(43).normal([self.N])
        assert self._corr(samples[0], other_seed) < 0.02
        # Consecutive draws of one stream and the numpy generators, too.
        stream = wide.for_replica(0)
        assert self._corr(stream.normal([self.N]), stream.normal([self.N])) < 0.02
        np_draws = [wide.numpy(r).normal(size=self.N) for r in range(2)]
        assert self._corr(*np_draws) < 0.02

    def test_frequencies_are_uniform(self):
        # Chi-square with 9 degrees of freedom; 27.88 is the 0.1% critical value.
        rng = ReplicaRNG(42, num_replicas=2)
        for stream in rng.streams:
            ints = stream.uniform_int([self.N], 0, 10).numpy()
            floats = stream.uniform([self.N]).numpy()
            for counts in (
                np.bincount(ints, minlength=10),
                np.histogram(floats, bins=10, range=(0.0, 1.0))[0],
            ):
                expected = self.N / 10
                chi2 = float(((counts - expected) ** 2 / expected).sum())
                assert counts.sum() == self.N and chi2 < 27.88, counts
            normals = stream.normal([self.N]).numpy()
            assert abs(normals.mean()) < 0.03 and abs(normals.std() - 1.0) < 0.03
            tn = stream.truncated_normal([self.N]).numpy()
            assert tn.min() >= -2.0 and tn.max() <= 2.0


class TestSchedulingAndTracing:
    def test_independent_of_retracing(self):
        rng, reference = ReplicaRNG(9), ReplicaRNG(9)
        traces = []

        @tf.function
        def draw(tag):  # A new Python tag forces a new trace on every call.
            traces.append(tag)
            return rng.normal([4]), rng.uniform_int([2], 0, 50)

        draw.get_concrete_function("warm-up")  # Tracing alone draws nothing.
        assert state_of(rng) == state_of(reference)
        for call in range(4):
            got = draw(f"call {call}")
            want = reference.normal([4]), reference.uniform_int([2], 0, 50)
            assert as_bytes(got) == as_bytes(want)
        same = tf.function(lambda: rng.normal([4]))
        for _ in range(3):  # One trace, three runs: three different draws.
            assert as_bytes([same()]) == as_bytes([reference.normal([4])])
        assert len(traces) == 5

    def test_threads_on_own_streams_match_a_sequential_run(self, mode):
        threads, iterations = 4, 25
        rng, reference = ReplicaRNG(31, num_replicas=threads), ReplicaRNG(31, num_replicas=threads)
        step = mode(lambda stream: (stream.normal([8]), stream.uniform_int([3], 0, 7)))
        # One traced function per stream in graph mode (a stream is a Python argument).
        got = [[] for _ in range(threads)]

        def work(index):
            stream = rng.for_replica(index)
            for _ in range(iterations):
                got[index].append(as_bytes(step(stream)))

        run_threads(threads, work)
        for index in range(threads):
            stream = reference.for_replica(index)
            want = [as_bytes(step(stream)) for _ in range(iterations)]
            assert got[index] == want
        assert state_of(rng) == state_of(reference)

    def test_threads_sharing_one_stream_never_get_the_same_values(self, mode):
        threads, iterations = 4, 40
        rng, reference = ReplicaRNG(32), ReplicaRNG(32)
        draw = mode(lambda: rng.make_seeds(2))
        got = [[] for _ in range(threads)]

        def work(index):
            for _ in range(iterations):
                got[index].append(draw().numpy().tobytes())

        run_threads(threads, work)
        sequential = [
            reference.make_seeds(2).numpy().tobytes() for _ in range(threads * iterations)
        ]
        flat = [b for per_thread in got for b in per_thread]
        assert sorted(flat) == sorted(sequential)  # Every value exactly once: atomic draws.
        assert len(set(flat)) == threads * iterations
        assert state_of(rng) == state_of(reference)


class TestCheckpoint:
    def test_restored_run_continues_exactly(self, tmp_path, mode):
        rng = ReplicaRNG(123, num_replicas=2)
        step = mode(
            lambda: (
                [rng.for_replica(r).normal([3]) for r in range(2)] + [rng.uniform_int([2], 0, 9)]
            )
        )
        step()
        step()
        path = tf.train.Checkpoint(rng=rng).write(str(tmp_path / "ckpt"))
        expected = [as_bytes(step()) for _ in range(3)]

        fresh = ReplicaRNG(123, num_replicas=2)
        tf.train.Checkpoint(rng=fresh).read(path).assert_consumed()
        fresh_step = mode(
            lambda: (
                [fresh.for_replica(r).normal([3]) for r in range(2)]
                + [fresh.uniform_int([2], 0, 9)]
            )
        )
        assert [as_bytes(fresh_step()) for _ in range(3)] == expected

        tf.train.Checkpoint(rng=rng).read(path).assert_consumed()  # Rewind the original.
        assert [as_bytes(step()) for _ in range(3)] == expected

    def test_saved_model_continues_the_streams(self, tmp_path):
        class Sampler(tf.Module):
            def __init__(self):
                super().__init__()
                self.rng = ReplicaRNG(5)

            @tf.function(input_signature=[])
            def draw(self):
                return self.rng.normal([3])

        sampler = Sampler()
        sampler.draw()
        tf.saved_model.save(sampler, str(tmp_path / "saved"))
        expected = [as_bytes([sampler.draw()]) for _ in range(2)]
        loaded = tf.saved_model.load(str(tmp_path / "saved"))
        assert [as_bytes([loaded.draw()]) for _ in range(2)] == expected

    def test_checkpoint_keys(self, tmp_path):
        rng = ReplicaRNG(1, num_replicas=2)
        path = tf.train.Checkpoint(rng=rng).write(str(tmp_path / "ckpt"))
        names = {name for name, _ in tf.train.list_variables(path)}
        assert {
            "rng/_streams/0/state/.ATTRIBUTES/VARIABLE_VALUE",
            "rng/_streams/1/state/.ATTRIBUTES/VARIABLE_VALUE",
        } <= names
        assert len(rng.trainable_variables) == 0 and len(rng.variables) == 2


class TestSeeds:
    def test_numpy_generators(self):
        rng, again = ReplicaRNG(5, num_replicas=2), ReplicaRNG(5, num_replicas=2)
        assert isinstance(rng.numpy(0), np.random.Generator)
        np.testing.assert_array_equal(rng.numpy(1).random(5), again.numpy(1).random(5))
        np.testing.assert_array_equal(rng.numpy(1).random(5), rng.numpy(1).random(5))
        assert not np.array_equal(rng.numpy(0).random(5), rng.numpy(1).random(5))
        assert not np.array_equal(rng.numpy(0, epoch=1).random(5), rng.numpy(0).random(5))
        assert rng.numpy().random() == rng.numpy(0).random()
        assert state_of(rng) == state_of(again)  # Pure: no stream moved.

    def test_seed_for(self):
        rng = ReplicaRNG(5, num_replicas=2)
        seeds = {rng.seed_for("dropout", replica_id=r) for r in range(2)}
        seeds |= {
            rng.seed_for("dropout", 1),
            rng.seed_for("noise"),
            rng.seed_for(0),
            rng.seed_for("0"),
        }
        assert len(seeds) == 6
        assert all(isinstance(s, int) and 0 <= s < 2**31 - 1 for s in seeds)
        assert rng.seed_for("dropout") == ReplicaRNG(5).seed_for("dropout")
        assert rng.for_replica(1).seed_for("x") == rng.seed_for("x", replica_id=1)

    def test_tf_data_seeds(self):
        rng = ReplicaRNG(8, num_replicas=2)

        def augmented(epoch, replica_id, parallel):
            data = tf.data.Dataset.range(64)
            seeds = rng.element_seeds(epoch, replica_id=replica_id)
            data = tf.data.Dataset.zip((data, seeds)).map(
                lambda i, seed: (
                    i,
                    tf.random.stateless_uniform([], seed, maxval=1000, dtype=tf.int64),
                ),
                **({"num_parallel_calls": parallel, "deterministic": False} if parallel else {}),
            )
            return dict(data.as_numpy_iterator())

        base = augmented(0, 0, None)
        assert augmented(0, 0, 4) == base  # Independent of parallelism and order.
        assert augmented(1, 0, None) != base and augmented(0, 1, None) != base
        direct = {
            i: int(
                tf.random.stateless_uniform(
                    [], rng.element_seed(i, 0, replica_id=0), maxval=1000, dtype=tf.int64
                )
            )
            for i in (0, 7)
        }
        assert direct == {0: base[0], 7: base[7]}

        def shuffled(epoch):
            seed = rng.dataset_seed(epoch, replica_id=1)
            return list(tf.data.Dataset.range(20).shuffle(20, seed=seed).as_numpy_iterator())

        assert shuffled(0) == shuffled(0) and shuffled(0) != shuffled(1)
        assert rng.dataset_seed(0, replica_id=0) != rng.dataset_seed(0, replica_id=1)


class TestKeras:
    def test_dropout_seed_is_reproducible_and_per_replica(self):
        import keras

        x = tf.ones([4, 64])

        def mask(rng, replica_id):
            layer = keras.layers.Dropout(0.5, seed=rng.seed_for("dropout", replica_id=replica_id))
            return layer(x, training=True).numpy()

        a, b = ReplicaRNG(77, num_replicas=2), ReplicaRNG(77, num_replicas=2)
        np.testing.assert_array_equal(mask(a, 0), mask(b, 0))
        assert not np.array_equal(mask(a, 0), mask(a, 1))

    def test_seed_generator_gives_each_replica_its_masks(self, mirrored_strategy):
        import keras

        x = tf.ones([1, 256])

        def masks(rng):
            with mirrored_strategy.scope():
                layer = keras.Sequential([keras.Input([256]), keras.layers.Dropout(0.5)])
                assert rng.attach(layer) == 1 and rng.attach(layer) == 0

            @tf.function
            def step():
                return mirrored_strategy.run(lambda: layer(x, training=True))

            return [
                [t.numpy() for t in mirrored_strategy.experimental_local_results(step())]
                for _ in range(2)
            ]

        first, again = masks(ReplicaRNG(3, num_replicas=2)), masks(ReplicaRNG(3, num_replicas=2))
        for call in range(2):
            for r in range(2):
                np.testing.assert_array_equal(first[call][r], again[call][r])
            assert not np.array_equal(first[call][0], first[call][1])  # Per replica.
        assert not np.array_equal(first[0][0], first[1][0])  # Fresh masks every step.
        gen = ReplicaRNG(3).keras_seed_generator()
        assert isinstance(gen, keras.random.SeedGenerator)
        assert gen.next().shape == [2]
        with pytest.raises(InvalidArgumentError, match="layer"):
            ReplicaRNG(3).attach(tf.Module())

    def test_seed_generator_class_keeps_its_public_name(self):
        # Built lazily in safevars/rng/keras_seed_generator.py, public (and serialized
        # by Keras) as safevars.rng.ReplicaSeedGenerator.
        import keras

        import safevars.rng
        from safevars.rng import ReplicaSeedGenerator

        gen = ReplicaRNG(3).keras_seed_generator("g")
        assert type(gen) is ReplicaSeedGenerator is safevars.rng.ReplicaSeedGenerator
        assert type(ReplicaRNG(3).for_replica(0).keras_seed_generator()) is ReplicaSeedGenerator
        assert ReplicaSeedGenerator.__module__ == "safevars.rng"
        config = keras.saving.serialize_keras_object(gen)
        assert (config["module"], config["class_name"], config["registered_name"]) == (
            "safevars.rng",
            "ReplicaSeedGenerator",
            "ReplicaSeedGenerator",
        )
        with pytest.raises(AttributeError, match="'safevars.rng' has no attribute 'NoSuchName'"):
            safevars.rng.NoSuchName  # noqa: B018

    def test_attached_layer_variables_stay_consistent(self):
        import keras

        model = keras.Sequential(
            [
                keras.Input([8]),
                keras.layers.Dense(4),
                keras.layers.Dropout(0.5),
                keras.layers.GaussianNoise(0.1),
            ]
        )
        count = len(model.variables)
        rng = ReplicaRNG(4)
        assert rng.attach(model) == 2
        assert len(model.variables) == count
        out = model(tf.ones([2, 8]), training=True)
        assert out.shape == [2, 4]
        assert rng.for_replica(0).state.numpy()[:2].tolist() != [0, 0]


class TestBadInput:
    @pytest.mark.parametrize("seed", [-1, 1.5, True, "3", None, np.float64(2.0)])
    def test_bad_seed(self, seed):
        with pytest.raises(InvalidArgumentError, match="seed") as info:
            ReplicaRNG(seed)
        assert isinstance(info.value, ValueError) and isinstance(info.value, SafeVarsError)
        assert "ReplicaRNG(seed=1234)" in str(info.value)

    def test_numpy_integer_seed_is_accepted(self):
        assert ReplicaRNG(np.int64(5)).streams[0].key == ReplicaRNG(5).streams[0].key

    @pytest.mark.parametrize("num_replicas", [0, -2, True, 2.0])
    def test_bad_num_replicas(self, num_replicas):
        with pytest.raises(InvalidArgumentError, match="num_replicas"):
            ReplicaRNG(1, num_replicas=num_replicas)

    @pytest.mark.parametrize("worker", [("worker",), ("", 0), ("worker", -1), "worker:0", (0, 0)])
    def test_bad_worker(self, worker):
        with pytest.raises(InvalidArgumentError, match="worker"):
            ReplicaRNG(1, worker=worker)

    def test_bad_calls_change_nothing(self):
        rng = ReplicaRNG(1, num_replicas=2)
        rng.normal([3])
        before = state_of(rng)
        bad = {
            "replica_id": [
                lambda: rng.for_replica(-1),
                lambda: rng.for_replica(2),
                lambda: rng.for_replica(True),
                lambda: rng.for_replica(1.0),
                lambda: rng.for_replica("0"),
                lambda: rng.seed_for("a", replica_id=5),
                lambda: rng.numpy(-1),
                lambda: rng.dataset_seed(0, replica_id=2),
            ],
            "count": [lambda: rng.make_seeds(0), lambda: rng.for_replica(1).make_seeds(1.5)],
            "epoch": [lambda: rng.numpy(0, epoch=-1), lambda: rng.element_seeds(epoch=True)],
            "index": [lambda: rng.element_seed(-3)],
            "keys": [lambda: rng.seed_for(-1), lambda: rng.seed_for(1.5)],
            "minval": [
                lambda: rng.uniform_int([2], 5, 5),
                lambda: rng.uniform([2], 1.0, 0.5),
                lambda: rng.uniform([2], minval=None),
                lambda: rng.uniform([2], minval=0, maxval=None, dtype=tf.int32),
            ],
            "dtype": [
                lambda: rng.normal([2], dtype=tf.int32),
                lambda: rng.uniform_int([2], 0, 3, dtype=tf.float32),
            ],
        }
        for argument, calls in bad.items():
            for call in calls:
                with pytest.raises(InvalidArgumentError, match=argument):
                    call()
        with pytest.raises(InvalidArgumentError, match="static value"):
            tf.function(rng.for_replica, autograph=False).get_concrete_function(
                tf.TensorSpec([], tf.int32)
            )
        assert state_of(rng) == before

    def test_messages_say_how_to_fix(self):
        with pytest.raises(InvalidArgumentError) as info:
            ReplicaRNG(1, num_replicas=2).for_replica(2)
        message = str(info.value)
        assert "replica_id=2" in message and "0..1" in message
        assert "strategy.scope()" in message

    def test_stream_type_and_repr(self):
        rng = ReplicaRNG(1)
        assert isinstance(rng.for_replica(0), ReplicaStream)
        assert rng.for_replica(tf.constant(0)) is rng.for_replica(0)
        assert "seed=1" in repr(rng) and "replica=0" in repr(rng.streams[0])


class TestPackage:
    def test_import_paths(self):
        import safevars
        import safevars.rng

        assert safevars.rng.ReplicaRNG is safevars.ReplicaRNG is ReplicaRNG
        assert safevars.rng.ReplicaStream is safevars.ReplicaStream is ReplicaStream
        assert safevars.rng.__all__ == ["ReplicaRNG", "ReplicaStream"]
