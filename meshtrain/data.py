"""Each node's stream of training batches: sharding, seeded shuffling, collation.

A node's whole data position is (epoch, position) plus the run seed, so a stream can
be rebuilt exactly (checkpoints) and two runtimes read the same samples in the same
order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from meshtrain.seeding import seeded_generator

Collate = Callable[[list[Any]], Any]


class DataFactory(Protocol):
    """Builds one node's dataset inside that node: ``f(rank, nodes, split)``, split "train"/"val"."""

    def __call__(self, rank: int, nodes: int, split: str) -> Dataset[Any]: ...


def resolve_dataset(
    data: Dataset[Any] | DataFactory, rank: int, nodes: int, split: str
) -> tuple[Dataset[Any], bool]:
    """The dataset a node reads, and whether it still has to be sharded."""
    if isinstance(data, Dataset):
        return data, True
    if callable(data):
        return data(rank, nodes, split), False
    raise TypeError(f"{split} data must be a torch Dataset or a factory f(rank, nodes, split)")


def fetch(dataset: Dataset[Any], indices: Sequence[int], collate_fn: Collate | None) -> Any:
    """Collate the samples at ``indices`` (one tensor index for a TensorDataset)."""
    if collate_fn is None and isinstance(dataset, TensorDataset):
        idx = torch.as_tensor(indices)
        return tuple(t[idx] for t in dataset.tensors)  # what default_collate would build
    samples = [dataset[i] for i in indices]
    return (collate_fn or default_collate)(samples)


class NodeBatches:
    """Batches of one node: its shard (every nodes-th sample from rank), reshuffled each epoch.

    The last incomplete batch of an epoch is dropped so every step sees ``batch_size``
    samples on every node.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        rank: int,
        nodes: int,
        batch_size: int,
        seed: int,
        shuffle: bool,
        shard: bool,
    ) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        if shard:
            usable = size - size % nodes  # equal shards
            self.indices = torch.arange(rank, usable, nodes)
        else:
            self.indices = torch.arange(size)
        if batch_size > len(self.indices):
            where = f"shard of node {rank} ({len(self.indices)} samples of {size} over {nodes} nodes)"
            raise ValueError(f"batch size {batch_size} is larger than the {where}")
        self.dataset = dataset
        self.rank = rank
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order()

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.indices) // self.batch_size

    def _epoch_order(self) -> list[int]:
        # A list, not a tensor: each step slices it, and a list slice costs no torch dispatch.
        if not self.shuffle:
            return self.indices.tolist()
        g = seeded_generator(self.seed, self.rank, self.epoch)
        return self.indices[torch.randperm(len(self.indices), generator=g)].tolist()

    def next_indices(self) -> list[int]:
        """Sample indices of the next batch (starts a new epoch when this one runs out)."""
        if self.position + self.batch_size > len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order()
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def resize(self, batch_size: int) -> None:
        """Take ``batch_size`` samples a step from now on (``balance``: this node's share)."""
        if not 1 <= batch_size <= len(self.indices):
            raise ValueError(f"node {self.rank}'s share of the batch, {batch_size} samples, does not "
                             f"fit its shard of {len(self.indices)} samples")
        self.batch_size = batch_size

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()


def split_microbatches(indices: list[int], microbatch_size: int | None) -> Iterator[list[int]]:
    """Consecutive pieces of a batch for gradient accumulation."""
    size = microbatch_size or len(indices)
    for start in range(0, len(indices), size):
        yield indices[start : start + size]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor inside a batch (tuples, lists, dicts, objects with .to)."""
    if device.type == "cpu" and not _has_non_cpu(batch):
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if hasattr(batch, "to"):
        return batch.to(device)
    return batch


def _has_non_cpu(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return batch.device.type != "cpu"
    if isinstance(batch, dict):
        return any(_has_non_cpu(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return any(_has_non_cpu(v) for v in batch)
    return hasattr(batch, "to")


class SharedBatches:
    """Batches of an elastic run (``launch --elastic``): one order per epoch for the whole
    run, and each step its members take consecutive batches of it in slot order.

    Every node holds this same object's state (a joiner receives it from a peer), so the
    nodes agree on who takes which samples without talking. What it guarantees, per epoch:
    every sample of the epoch's order is drawn exactly once by a node whose work reached the
    global model, except the tail of fewer than ``members * batch_size`` samples the epoch
    ends on (dropped, as :class:`NodeBatches` drops its last incomplete batch). The samples
    a lost node drew since the last sync (its work of that round never reached the global
    model) are drawn again, first, by the nodes that go on (:meth:`members_lost`).
    """

    def __init__(self, dataset: Dataset[Any], *, slot: int, slots: int, batch_size: int, seed: int,
                 shuffle: bool) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        if batch_size * slots > size:
            raise ValueError(f"batch size {batch_size} on {slots} nodes needs {batch_size * slots} samples "
                             f"a step; the data has {size}")
        self.dataset = dataset
        self.indices = torch.arange(size)  # what NodeBatches calls its shard: all of it
        self.slot = slot
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.members: list[int] = list(range(slots))
        self.epoch = 0
        self.position = 0
        self.again: list[int] = []  # a lost node's samples, drawn again first
        self.round: dict[int, list[int]] = {}  # each member's samples since the last sync
        self._order = self._epoch_order()

    def __len__(self) -> int:
        """Batches per node per epoch with every slot in."""
        return len(self.indices) // (self.batch_size * len(self.members))

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return self.indices.tolist()
        g = seeded_generator(self.seed, -1, self.epoch)  # one order for every node
        return torch.randperm(len(self.indices), generator=g).tolist()

    def next_indices(self) -> list[int]:
        """This node's batch of the next step; every member's draw of it is remembered."""
        need = self.batch_size * len(self.members)
        if len(self.again) + len(self._order) - self.position < need:
            self.epoch += 1
            self.position = 0
            self.again = []  # the tail: dropped with the epoch
            self._order = self._epoch_order()
        take = min(need, len(self.again))
        step = self.again[:take] + self._order[self.position:self.position + need - take]
        self.again = self.again[take:]
        self.position += need - take
        mine: list[int] = []
        for i, member in enumerate(self.members):
            batch = step[i * self.batch_size:(i + 1) * self.batch_size]
            self.round.setdefault(member, []).extend(batch)
            if member == self.slot:
                mine = batch
        return mine

    def synced(self) -> None:
        """A sync took every member's work of the round into the global model."""
        self.round = {}

    def members_lost(self, lost: list[int]) -> None:
        """``lost`` left before their round's work reached the global model: their samples
        of the round are drawn again, first."""
        for member in sorted(lost):
            self.again.extend(self.round.pop(member, []))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "again": list(self.again),
                "round": {m: list(v) for m, v in self.round.items()}, "members": list(self.members)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.again = [int(i) for i in state["again"]]
        self.round = {int(m): [int(i) for i in v] for m, v in state["round"].items()}
        self.members = [int(m) for m in state.get("members", self.members)]
        self._order = self._epoch_order()
