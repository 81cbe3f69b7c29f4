"""Shared test fixtures: tiny models and datasets.

Everything here is module-level so it pickles for the processes runtime.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

IN_FEATURES = 6
HIDDEN = 8
OUT_FEATURES = 2


class MLP(nn.Module):
    """A small regression MLP; ``model((x, y))`` returns the mean squared error."""

    def __init__(self, seed: int = 0, dropout: float = 0.0, activation: str = "tanh") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT_FEATURES)
        self.act = nn.Tanh() if activation == "tanh" else nn.ReLU()
        self.drop = nn.Dropout(dropout)

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch[0], batch[1]
        out = self.fc2(self.drop(self.act(self.fc1(x))))
        return ((out - y) ** 2).mean()


def mlp_param_count() -> int:
    return IN_FEATURES * HIDDEN + HIDDEN + HIDDEN * OUT_FEATURES + OUT_FEATURES


def regression_data(n: int = 96, seed: int = 1) -> TensorDataset:
    """``n`` samples (x, y) of a fixed random nonlinear map."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, OUT_FEATURES, generator=g)
    return TensorDataset(x, y)


class Scalar(nn.Module):
    """One scalar parameter ``theta`` with loss ``theta`` (gradient exactly 1)."""

    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(value))

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.theta * batch[0].new_ones(()).mean()


class Sized(nn.Module):
    """A linear map with exactly ``rows * cols`` trainable parameters (no bias) and a
    frozen buffer-like parameter that must never be communicated."""

    def __init__(self, rows: int = 8, cols: int = IN_FEATURES, frozen: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(rows, cols) * 0.1)
        self.frozen = nn.Parameter(torch.randn(frozen), requires_grad=False)

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = batch[0]
        return ((x @ self.weight.T) ** 2).mean() + 0 * self.frozen.sum()


class RankedData(Dataset):
    """Samples (x, y, rank): every item carries the rank of the node that built it."""

    def __init__(self, rank: int, n: int = 32) -> None:
        self.rank = rank
        self.data = regression_data(n, seed=10 + rank)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return x, y, torch.tensor(self.rank)


def ranked_factory(rank: int, nodes: int, split: str) -> Dataset:
    """A data factory ``f(rank, nodes, split)``: each node gets its own RankedData."""
    return RankedData(rank, n=32 if split == "train" else 8)


class FailOnRank(MLP):
    """An MLP whose forward raises on the node whose data carries ``rank`` at ``at_call``."""

    def __init__(self, rank: int = 1, at_call: int = 3) -> None:
        super().__init__()
        self.fail_rank = rank
        self.at_call = at_call
        self.calls = 0

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.training and int(batch[2][0]) == self.fail_rank:
            if self.calls == self.at_call:
                raise RuntimeError(f"boom on rank {self.fail_rank} at step {self.calls}")
            self.calls += 1
        return super().forward(batch)


class ExitOnRank(FailOnRank):
    """Kills its own process (exit code 3, no exception) at ``at_call`` on ``rank``."""

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.training and int(batch[2][0]) == self.fail_rank and self.calls == self.at_call:
            import os

            os._exit(3)
        return super().forward(batch)


class SleepOnRank(FailOnRank):
    """Stalls for ``seconds`` at ``at_call`` on ``rank`` (a node that hangs, not one that raises)."""

    def __init__(self, rank: int = 1, at_call: int = 1, seconds: float = 20.0) -> None:
        super().__init__(rank, at_call=10**9)
        self.sleep_at = at_call
        self.seconds = seconds
        self.sleep_calls = 0

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.training and int(batch[2][0]) == self.fail_rank:
            if self.sleep_calls == self.sleep_at:
                import time

                time.sleep(self.seconds)
            self.sleep_calls += 1
        return super().forward(batch)


class NeedsEnvironment(MLP):
    """An MLP whose training steps fail unless the node's environment has :attr:`VARIABLE`."""

    VARIABLE = "MESHTRAIN_TEST_NODE_ENV"

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        import os

        if self.training and self.VARIABLE not in os.environ:
            raise RuntimeError(f"{self.VARIABLE} is not set in this node")
        return super().forward(batch)


class IndexData(Dataset):
    """Item i is the tensor [i] (to see exactly which samples a node reads)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_states_equal(a: nn.Module, b: nn.Module) -> None:
    """Every tensor bit-identical."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs: max |diff| {(sa[k] - sb[k]).abs().max()}"


def run_jobs_as_nodes(jobs: list, ports: list[int], rank: int, results: object) -> None:
    """One node process of the processes runtime, running several jobs back to back.

    Each job goes through the runtime's own node entry point (``_node_process``: one
    intra-op thread, a fresh gloo group, the node seed), so only the process start-up
    is shared between jobs.
    """
    from meshtrain.engine.runtimes.processes import _node_process

    for job, port in zip(jobs, ports, strict=True):
        _node_process(job, rank, port, results)


def unequal_factory(rank: int, nodes: int, split: str) -> Dataset:
    """Node r gets 16 + 8 r samples of its own (FedAvg's weighted average matters)."""
    return regression_data(16 + 8 * rank, seed=20 + rank)


# ------------------------------------------------------------------ communicator scripts
ORDER_VALUES = (1e8, 1.0, -1e8)  # float32 sums that depend on the order of the ring


def comm_script(comm) -> dict:
    """The same collectives on any backend; returns what each produced on this node."""
    world, rank = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(100 + rank)
    a = torch.randn(1001, generator=g)  # 1001 values: uneven ring chunks
    out: dict = {}

    def wire() -> tuple[int, int]:
        return getattr(comm, "wire_sent", 0), getattr(comm, "wire_received", 0)

    out["wire"] = []
    for op in ("mean", "sum", "max"):
        t = a.clone()
        before = wire()
        comm.all_reduce(t, op=op)
        after = wire()
        out["wire"].append((after[0] - before[0], after[1] - before[1]))
        out[f"all_reduce_{op}"] = t
    bucket = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g)]
    comm.all_reduce(bucket, op="mean")
    out["bucket"] = bucket
    before = wire()
    out["all_gather"] = torch.stack(comm.all_gather(a[:10].clone()))
    after = wire()
    out["wire"].append((after[0] - before[0], after[1] - before[1]))
    out["all_gather_int16"] = torch.stack(comm.all_gather(torch.arange(5, dtype=torch.int16) + rank))
    b = a[:17].clone()
    comm.broadcast(b, src=world - 1)
    out["broadcast"] = b
    group = [0, world - 1]
    if rank in group:
        t = a.clone()
        comm.all_reduce(t, op="sum", group=group)
        out["group"] = t
    if world == len(ORDER_VALUES):
        t = torch.full((world,), ORDER_VALUES[rank], dtype=torch.float32)
        comm.all_reduce(t, op="sum")
        out["order"] = t
    # The gloo ring keeps its receive space between calls: then a new dtype, a larger message.
    d = a[:300].double() * (rank + 1)
    comm.all_reduce(d, op="sum")
    out["all_reduce_float64"] = d
    grown = torch.randn(2500, generator=g)
    comm.all_reduce(grown, op="sum")
    out["all_reduce_grown"] = grown
    out["log"] = [(r.kind, r.bytes_sent, r.bytes_received, r.group_size) for r in comm.log.records]
    return out


def gloo_comm_worker(rank: int, world: int, port: int, results: object, backend: str | None = None) -> None:
    """One spawned process: join a gloo group, run :func:`comm_script`, send back its results.
    With ``backend`` (such as ``"cpu:gloo"``) the group is made with that backend string
    instead of meshtrain's own choice for the CPU."""
    import io

    import torch.distributed as dist

    from meshtrain.comm import torch_dist
    from meshtrain.comm.torch_dist import TorchDistCommunicator, init_process_group

    # Pieces of 256 bytes: each ring step's chunk of the 1001 values moves as several pipelined
    # pieces (real messages that big are rare in the suite since pieces are 2 MiB).
    torch_dist.PIECE_BYTES = 256

    class Counting(TorchDistCommunicator):
        """Counts the bytes that really cross the wire in the ring's point-to-point steps."""

        wire_sent = 0
        wire_received = 0

        def _exchange(self, send, dst, recv, src):
            self.wire_sent += send.numel() * send.element_size()
            self.wire_received += recv.numel() * recv.element_size()
            super()._exchange(send, dst, recv, src)

        def _exchange_now(self, send, dst, recv, src):  # one batch, not through _exchange
            self.wire_sent += send.numel() * send.element_size()
            self.wire_received += recv.numel() * recv.element_size()
            super()._exchange_now(send, dst, recv, src)

    torch.set_num_threads(1)
    if backend is None:
        init_process_group(rank, world, "127.0.0.1", port, torch.device("cpu"), 60.0)
    else:
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    try:
        out = comm_script(Counting())
    finally:
        dist.destroy_process_group()
    buf = io.BytesIO()
    torch.save(out, buf)
    results.put((rank, buf.getvalue()))


#: Processes of gloo_retire_worker's group: 3, since with 2 a sum goes to gloo's own all-reduce
#: (a + b == b + a) and posts no request of the communicator's.
RETIRE_WORLD = 3


def gloo_retire_worker(rank: int, port: int, results: object) -> None:
    """One of RETIRE_WORLD spawned processes: collectives back to back, small and larger
    than ``RETIRED_BYTES``; reports each result's correctness and how many finished
    requests the communicator keeps alive after it."""
    import torch.distributed as dist

    from meshtrain.comm import torch_dist
    from meshtrain.comm.communicator import ring_reduce
    from meshtrain.comm.torch_dist import TorchDistCommunicator, init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, RETIRE_WORLD, "127.0.0.1", port, torch.device("cpu"), 60.0)
    comm = TorchDistCommunicator()

    report: list[tuple[str, bool, int]] = []
    try:
        large = torch_dist.RETIRED_BYTES // 4 + 1001  # float32 elements: above the bound
        for n in [1001, 65_536, large, 1001]:
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * r + n % 7))
                  for r in range(RETIRE_WORLD)]
            for _ in range(3):
                mine = xs[rank].clone()
                comm.all_reduce(mine, op="sum")
                exact = torch.equal(mine, ring_reduce(xs, "sum"))
                report.append((f"all_reduce {n}", exact, len(comm._retired)))
            gathered = comm.all_gather(xs[rank])
            exact = all(torch.equal(g, x) for g, x in zip(gathered, xs, strict=True))
            report.append((f"all_gather {n}", exact, len(comm._retired)))
            sent = [xs[rank].clone()]
            comm.broadcast(sent, src=1)
            report.append((f"broadcast {n}", torch.equal(sent[0], xs[1]), len(comm._retired)))
    finally:
        dist.destroy_process_group()
    results.put((rank, report))  # type: ignore[attr-defined]


class CrashesAt(MLP):
    """An MLP with dropout whose every node raises at forward call ``at_call`` (a run that
    is interrupted part-way); ``at_call=None`` never raises."""

    def __init__(self, at_call: int | None = None) -> None:
        super().__init__(dropout=0.1)
        self.at_call = at_call
        self.calls = 0

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at_call:
                raise RuntimeError(f"interrupted at forward call {self.calls}")
        return super().forward(batch)


class FunctionalDropoutMLP(MLP):
    """Draws random numbers without any nn.Dropout module (F.dropout in forward), as many
    Hugging Face models and nn.MultiheadAttention(dropout=...) do."""

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch[0], batch[1]
        hidden = nn.functional.dropout(self.act(self.fc1(x)), p=0.3, training=self.training)
        return ((self.fc2(hidden) - y) ** 2).mean()


class WideMLP(MLP):
    """About 1 MB of parameters: several of DDP's gradient buckets (comm/buckets.py), one
    of them holding a layer no node ever uses (no gradient anywhere)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.fc1 = nn.Linear(IN_FEATURES, 256)
        self.wide = nn.Linear(256, 512)  # 512 KiB: a bucket of its own
        self.unused = nn.Linear(4, 4)
        self.narrow = nn.Linear(512, 256)  # 512 KiB
        self.fc2 = nn.Linear(256, OUT_FEATURES)

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch[0], batch[1]
        out = self.fc2(self.act(self.narrow(self.act(self.wide(self.act(self.fc1(x)))))))
        return ((out - y) ** 2).mean()


def tiny_gpt() -> nn.Module:
    """A 4-layer gpt-task model with dropout, the same initial weights every time."""
    from meshtrain.tasks.gpt import CharGPT

    torch.manual_seed(0)
    return CharGPT(40, block_size=32, layers=4, dim=64, dropout=0.1)


class Windows(Dataset):
    """Seeded random token windows of 32 characters for the gpt-task model: (input, target)."""

    def __init__(self, n: int = 64, block: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 40, (n, block + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


def tiny_whisper() -> nn.Module:
    """A 2-layer Whisper of random weights with LoRA adapters (dropout 0.1), seeded."""
    from transformers import WhisperConfig

    from meshtrain.hf import HFModel, LoRA
    from meshtrain.hf.tiny import TINY_CONFIG

    config = WhisperConfig(**TINY_CONFIG, vocab_size=96, decoder_start_token_id=1, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    return HFModel.from_config(config, lora=LoRA(r=4, dropout=0.1), seed=0, wer=False)


class Clips(Dataset):
    """Random log-mel features and labels of the tiny Whisper's shape (seeded)."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.features = torch.randn(n, 80, 300, generator=g)
        self.labels = torch.randint(3, 96, (n, 12), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_features": self.features[i], "labels": self.labels[i]}
