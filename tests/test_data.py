"""Each node's data: sharding, seeded shuffling, factories, microbatches."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import MLP, IndexData, regression_data, unequal_factory
from torch import nn
from torch.testing import assert_close

from meshtrain import NodeFailed, Trainer
from meshtrain.data import NodeBatches, resolve_dataset, split_microbatches
from meshtrain.strategies import DDP, FedAvg


def batches(n=103, nodes=4, rank=0, batch_size=5, seed=0, shuffle=True, shard=True):
    return NodeBatches(IndexData(n), rank=rank, nodes=nodes, batch_size=batch_size, seed=seed,
                       shuffle=shuffle, shard=shard)


def read(stream, count):
    return [stream.next_indices() for _ in range(count)]


def test_shards_are_disjoint_equal_and_strided():
    shards = [batches(rank=r).indices.tolist() for r in range(4)]
    assert [len(s) for s in shards] == [25] * 4  # 103 samples: the last 3 are left out
    assert sorted(sum(shards, [])) == list(range(100))
    assert shards[1][:3] == [1, 5, 9]


def test_shuffle_false_reads_in_order_epoch_after_epoch():
    stream = batches(n=40, nodes=2, rank=1, batch_size=6, shuffle=False)
    got = read(stream, 6)  # 20 samples, 3 full batches per epoch (2 samples dropped)
    shard = list(range(1, 40, 2))
    assert got[:3] == [shard[0:6], shard[6:12], shard[12:18]]
    assert got[3:] == got[:3]
    assert len(stream) == 3


def test_shuffle_new_order_each_epoch_reproducible_with_seed():
    stream = batches(n=80, nodes=2, rank=0, batch_size=8, seed=7)  # 5 batches per epoch
    epochs = [sum(read(stream, 5), []) for _ in range(3)]
    shard = list(range(0, 80, 2))
    for order in epochs:
        assert sorted(order) == shard  # each epoch is a permutation of the shard
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != shard
    again = batches(n=80, nodes=2, rank=0, batch_size=8, seed=7)
    assert sum(read(again, 15), []) == sum(epochs, [])
    other = batches(n=80, nodes=2, rank=0, batch_size=8, seed=8)
    assert sum(read(other, 5), []) != epochs[0]


def test_stream_resumes_from_its_state():
    stream = batches(seed=3)
    read(stream, 7)  # into the second epoch
    state = stream.state_dict()
    expected = read(stream, 6)
    resumed = batches(seed=3)
    resumed.load_state_dict(state)
    assert read(resumed, 6) == expected


def test_batch_larger_than_shard_raises_value_error_naming_it():
    with pytest.raises(ValueError, match=r"batch size 30 is larger than the shard of node 2 \(25 samples"):
        batches(n=100, nodes=4, rank=2, batch_size=30)
    batches(n=100, nodes=4, rank=2, batch_size=25)  # exactly a shard is fine


def test_fit_reports_the_oversized_batch(tmp_path):
    with pytest.raises((ValueError, NodeFailed), match="batch size 20 is larger than the shard"):
        Trainer(MLP(), regression_data(40)).fit(DDP("sgd", 0.1), nodes=4, max_steps=2, batch_size=20,
                                                out_dir=tmp_path, progress=False)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize(("samples", "nodes", "batch", "message"), [
    (40, 4, 20, r"\(10 samples of 40 over 4 nodes\); use a batch size of at most 10, fewer nodes or more "
                r"data$"),
    (3, 3, 4, r"\(1 sample of 3 over 3 nodes\); use a batch size of at most 1, "),
    (2, 3, 1, r"\(0 samples of 2 over 3 nodes\); use at most 2 nodes or more data$"),
])
def test_the_oversized_batch_error_says_what_would_fit(samples, nodes, batch, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        Trainer(MLP(), regression_data(samples)).fit(DDP("sgd", 0.1), nodes=nodes, max_steps=2,
                                                     batch_size=batch, out_dir=tmp_path, progress=False)


def test_fit_raises_value_error_for_oversized_batch(tmp_path):
    with pytest.raises(ValueError, match="batch size 20"):
        Trainer(MLP(), regression_data(40)).fit(DDP("sgd", 0.1), nodes=4, max_steps=2, batch_size=20,
                                                out_dir=tmp_path, progress=False)


class Recorder(nn.Module):
    """Records every training sample index a node reads (the threads share this class)."""

    seen: dict[int, list[int]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        values = batch.reshape(-1).tolist()
        Recorder.seen.setdefault(values[0] // 1000, []).extend(values)
        return (self.w - 1).pow(2).sum()


class Offset(torch.utils.data.Dataset):
    """Item i of node r is 1000 r + i."""

    def __init__(self, rank: int, n: int) -> None:
        self.rank, self.n = rank, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([1000 * self.rank + i])


def offset_factory(rank, nodes, split):
    return Offset(rank, 6 + rank)


def test_factory_dataset_is_used_as_is_per_node(tmp_path):
    Recorder.seen.clear()
    Trainer(Recorder(), offset_factory).fit(FedAvg(H=100), nodes=3, max_steps=3, batch_size=2,
                                           shuffle=False, out_dir=tmp_path, progress=False)
    # Never sharded: node r reads its own 6 + r samples from the start, in order.
    assert Recorder.seen == {r: [1000 * r + i for i in range(6)] for r in range(3)}
    data, shard = resolve_dataset(offset_factory, 2, 3, "val")
    assert not shard and len(data) == 8


class ThreadRecorder(Recorder):
    """Records samples by the node thread that read them (threads runtime)."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        Recorder.seen.setdefault(threading.current_thread().name, []).extend(batch.reshape(-1).tolist())
        return (self.w - 1).pow(2).sum()


def test_dataset_is_sharded_by_stride_in_fit(tmp_path):
    Recorder.seen.clear()
    Trainer(ThreadRecorder(), IndexData(14)).fit(FedAvg(H=100), nodes=3, max_steps=2, batch_size=2,
                                                 shuffle=False, out_dir=tmp_path, progress=False)
    # 14 samples over 3 nodes: shards of 4 (the last 2 samples are never read).
    assert Recorder.seen == {f"meshtrain-node-{r}": [r, r + 3, r + 6, r + 9] for r in range(3)}


def test_split_microbatches():
    assert list(split_microbatches([1, 2, 3, 4, 5], 2)) == [[1, 2], [3, 4], [5]]
    assert list(split_microbatches([1, 2, 3], None)) == [[1, 2, 3]]


@pytest.mark.parametrize("micro", [1, 3, 4])
def test_microbatch_accumulation_equals_full_batch(micro, tmp_path):
    data = regression_data(64)
    kw = dict(nodes=2, max_steps=4, batch_size=8, shuffle=True, out_dir=tmp_path, progress=False)
    full = Trainer(MLP(), data).fit(DDP("sgd", 0.1), **kw)
    accumulated = Trainer(MLP(), data).fit(DDP("sgd", 0.1), microbatch_size=micro, **kw)
    for a, b in zip(full.model.parameters(), accumulated.model.parameters(), strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_close(torch.tensor([r["train_loss"] for r in full.history]),
                 torch.tensor([r["train_loss"] for r in accumulated.history]), rtol=1e-5, atol=1e-6)


def test_microbatch_size_must_fit_the_batch(tmp_path):
    with pytest.raises(ValueError, match="microbatch_size"):
        Trainer(MLP(), regression_data(64)).fit(DDP("sgd", 0.1), nodes=1, max_steps=1, batch_size=4,
                                                microbatch_size=5, out_dir=tmp_path, progress=False)


def test_epochs_set_the_step_count(tmp_path):
    # 96 samples over 4 nodes: shards of 24, 6 batches of 4 per epoch.
    res = Trainer(MLP(), regression_data(96)).fit(DDP("sgd", 0.1), nodes=4, epochs=1.5, batch_size=4,
                                                  out_dir=tmp_path, progress=False)
    assert res.summary["steps"] == 9 and len(res.history) == 9


def test_epochs_with_unequal_factory_data_agree_on_steps(tmp_path):
    res = Trainer(MLP(), unequal_factory).fit(DDP("sgd", 0.1), nodes=3, epochs=1, batch_size=4,
                                              out_dir=tmp_path, progress=False, timeout_s=10)
    assert res.summary["steps"] in (4, 8)  # 16 and 32 samples: the shortest or the longest epoch
