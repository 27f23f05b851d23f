"""``ElasticSampler``: Horovod's sampler that repartitions the rest of an epoch after a reset.

The epoch's order is one seeded shuffle of every index, the same on every rank. What is done is
counted as Horovod 0.28 counts it, ``processed_num`` (``record_batch`` adds
``batch_size * num_replicas``), so the remaining indices are a suffix of that order; what is
left is padded to a multiple of the world size and dealt out ``rank::size``, as
``torch.utils.data.DistributedSampler`` does. ``record_indices`` (Horovod 0.20-0.22's API) marks
single indices as done on top of that; they are skipped too.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set

import torch.utils.data

from ..runtime import basics


def _world() -> tuple:
    return basics.rank(), basics.size()


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across ranks and repartitions what is left of the epoch after a
    reset (track it in a :class:`TorchState`; call :meth:`record_batch` after each batch and
    :meth:`set_epoch` at the end of each epoch).

    Args:
        dataset: A sized dataset (its length must not change).
        shuffle: Shuffle the indices, seeded by ``seed + epoch`` (default True).
        seed: The shuffle's seed, the same on every rank (default 0).
        world: Returns ``(rank, size)`` at each reset (default: hvd_slim's; not in Horovod,
            for tests).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0,
                 world: Optional[Callable[[], tuple]] = None) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._world = world or _world   # (rank, size); tests pass their own
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: Set[int] = set()
        self.rank, self.num_replicas = 0, 1
        self.remaining_indices: List[int] = []
        self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order (when shuffling), nothing processed yet. Call it at
        the end of an epoch, so that a reset within one does not repeat its samples.

        Args:
            epoch: The epoch number.

        Returns:
            None.
        """
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples on every rank as processed.

        Args:
            batch_idx: The batch's index (unused, as in Horovod).
            batch_size: Samples per rank in the batch.

        Returns:
            None.
        """
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset ``indices`` as processed; the next :meth:`reset` leaves them out.

        Args:
            indices: Dataset indices.

        Returns:
            None.
        """
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> Dict[str, Any]:
        """The epoch and what has been processed in it.

        Returns:
            ``{"epoch", "processed_num", "processed_indices"}``.
        """
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (Horovod's, without ``processed_indices``, loads too)
        and repartition for the current world.

        Args:
            state_dict: As returned by :meth:`state_dict`.

        Returns:
            None.
        """
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict.get("processed_num", 0))
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self) -> None:
        """Repartition what is left of the epoch over the current ranks (rank and size are
        read now, so after hvd_slim was rebuilt on the survivors).

        Returns:
            None.
        """
        self.rank, self.num_replicas = self._world()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = [i for i in order[self.processed_num:]
                                  if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        # Pad by repeating from the start so every rank gets num_samples (as Horovod).
        while len(indices) < self.total_size:
            indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
