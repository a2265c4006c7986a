"""Restart in the middle of an epoch: plain sharding repeats or loses elements, safevars does not.

Run: python examples/sharded_input.py [--seed 7] [--verbose]

Two workers each read their shard of 20 elements, reshuffled every epoch. The job is
checkpointed after epoch 0 and 4 elements of epoch 1 per worker, dies, and restarts from
the checkpoint. Then epoch 1 (before and after the restart, both workers together) should
hold every element exactly once:

* ``dataset.shard(2, w).shuffle(...)`` restarted at the beginning of the epoch (what
  ``Model.fit(initial_epoch=...)`` does): the elements read before the crash come twice;
* the same pipeline with a shuffle seed that differs between processes (the default is a
  random one), restarted with ``skip(elements already read)``: the skipped elements are
  not the ones that were read, so some come twice and others never;
* ``safevars.data.ShardedInput``: the position is in the checkpoint; the restarted
  pipeline continues with exactly the elements that would have come.

Each line prints the lost and duplicated counts of epoch 1; the checks print ``True``.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

from _quiet import add_verbose_argument, quiet_tensorflow_startup  # examples/_quiet.py

quiet_tensorflow_startup()  # before TensorFlow is imported; --verbose shows its C++ start-up log

import tensorflow as tf  # noqa: E402

from safevars.data import ShardedInput  # noqa: E402

N, WORKERS = 20, 2
PER_SHARD = N // WORKERS
BEFORE_CRASH = PER_SHARD + 4  # all of epoch 0, then 4 elements of epoch 1


def lost_and_duplicated(epoch: list[int]) -> tuple[int, int]:
    counts = collections.Counter(epoch)
    return (
        sum(1 for i in range(N) if counts[i] == 0),
        sum(c - 1 for c in counts.values() if c > 1),
    )


def plain(worker: int, seed: int) -> tf.data.Dataset:
    return (
        tf.data.Dataset.range(N)
        .shard(WORKERS, worker)
        .shuffle(PER_SHARD, seed=seed, reshuffle_each_iteration=True)
        .repeat()
    )


def plain_epoch_1(seed: int, restart_seed: int, resume: str) -> list[int]:
    """Epoch 1 of both workers: 4 elements before the crash, the rest after the restart."""
    epoch = []
    for worker in range(WORKERS):
        before = [int(x) for x in plain(worker, seed).take(BEFORE_CRASH)]
        epoch += before[PER_SHARD:]
        if resume == "epoch start":  # epoch 1 from its first element again
            after = plain(worker, restart_seed).skip(PER_SHARD).take(PER_SHARD)
        else:  # skip what was read; the rest of epoch 1
            after = plain(worker, restart_seed).skip(BEFORE_CRASH).take(PER_SHARD - 4)
        epoch += [int(x) for x in after]
    return epoch


def read(data: ShardedInput, worker: int, count: int) -> list[int]:
    """``count`` elements of ``worker``'s shard, each committed once used."""
    out = []
    for element, receipt in data.dataset(worker).take(count):
        out.append(int(element))
        data.commit(receipt)  # "trained on": the position moves past it
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    add_verbose_argument(parser)
    args = parser.parse_args()

    restart_at_epoch_start = plain_epoch_1(args.seed, args.seed, "epoch start")
    print(
        "plain shard().shuffle(), restarted at the epoch start: lost %d, duplicated %d"
        % lost_and_duplicated(restart_at_epoch_start)
    )
    other_seed = plain_epoch_1(args.seed, args.seed + 1, "skip")
    print(
        "plain shard().shuffle(), another seed after the restart, skip(): lost %d, "
        "duplicated %d" % lost_and_duplicated(other_seed)
    )

    def make() -> ShardedInput:
        return ShardedInput(N, seed=args.seed, num_workers=WORKERS)

    uninterrupted = make()
    reference = [read(uninterrupted, w, 2 * PER_SHARD) for w in range(WORKERS)]
    with tempfile.TemporaryDirectory() as tmp:
        data = make()
        before = [read(data, w, BEFORE_CRASH) for w in range(WORKERS)]
        path = tf.train.Checkpoint(data=data).write(os.path.join(tmp, "ckpt"))
        del data  # the job dies
        restarted = make()
        tf.train.Checkpoint(data=restarted).read(path).assert_consumed()
        print(
            "restored positions (epoch, offset):", [restarted.position(w) for w in range(WORKERS)]
        )
        after = [read(restarted, w, PER_SHARD - 4) for w in range(WORKERS)]
    epoch_1 = [i for w in range(WORKERS) for i in before[w][PER_SHARD:] + after[w]]
    print(
        "safevars ShardedInput, restarted from the checkpoint: lost %d, duplicated %d"
        % lost_and_duplicated(epoch_1)
    )
    print("epoch 1 is every element exactly once:", sorted(epoch_1) == list(range(N)))
    print(
        "restarted run continues exactly:",
        [before[w] + after[w] for w in range(WORKERS)] == reference,
    )
    epoch_0 = [reference[w][:PER_SHARD] for w in range(WORKERS)]
    print("shards are disjoint:", not set(epoch_0[0]) & set(epoch_0[1]))
    print("epoch 1 is reshuffled:", [r[PER_SHARD:] for r in reference] != epoch_0)
    print("worker 0, epoch 0:", epoch_0[0])


if __name__ == "__main__":
    main()
