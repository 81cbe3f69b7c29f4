"""Collectives over torch.distributed (gloo on CPU/MPS; on CUDA nccl, and gloo for CPU tensors).

The ring is written with point-to-point send/recv on the default group, so

* any subset of ranks can form a group with no ``new_group`` call (islands that
  change every round cost nothing to set up), and
* chunks are summed in exactly the order :func:`ring_reduce` uses, which makes a
  run on processes or real hosts bit-identical to one on threads.

With exactly two ranks, a sum or mean is gloo's own all-reduce instead: each element is one
addition, and ``a + b == b + a`` bit for bit.
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.comm import rendezvous, sealing
from meshtrain.comm.communicator import Communicator, ReduceOp, _combine_


class TorchDistCommunicator(Communicator):
    """A node's collectives over an initialised torch.distributed default group."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        self._setup(dist.get_rank(), dist.get_world_size(), group, dist.get_backend())

    def _setup(self, rank: int, world_size: int, group: Any, backend: str) -> None:
        Communicator.__init__(self, rank, world_size)
        #: The process group its messages travel in (None: the default group); a side
        #: channel has a group of its own, so its rings never mix with the node thread's.
        self.group = group
        self.backend = backend  # "gloo", or "cpu:gloo,cuda:nccl" (backend_for)
        self.moves_cuda = "nccl" in self.backend
        self._sends: list[Any] = []  # requests posted and not yet waited for
        self._receives: list[Any] = []
        self._finished: list[Any] = []  # requests waited for, kept alive a while (_retire)
        self._finished_bytes = 0  # the bytes their tensors hold
        self._retired: list[Any] = []
        # gloo's point-to-point calls may come from any thread; the node's own thread
        # posts nothing while a bucket is in flight (GradientBuckets waits for it first).
        self.reduces_in_background = self.backend == "gloo"
        self._scratch = torch.empty(0)  # the ring's receive space, kept from call to call
        self._side: TorchDistCommunicator | None = None

    @property
    def group_size(self) -> int:
        """How many ranks the process group holds."""
        return self.world_size

    def _sum_over_group(self, flat: torch.Tensor) -> None:
        """gloo's own all-reduce (a sum, in place) over the whole process group."""
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)

    def open_side_channel(self) -> Communicator | None:
        """On gloo: a communicator over a process group of its own (every rank's), so a ring
        it runs on another thread never mixes its messages with the node thread's
        (point-to-point messages between two ranks of one group match in posting order).
        Every rank creates the group at the same point: a strategy's ``setup``."""
        if self.backend != "gloo":
            return None
        if self._side is None:
            self._side = TorchDistCommunicator(dist.new_group(backend="gloo"))
        return self._side

    def staging_device(self, tensor: torch.Tensor) -> torch.device:
        # nccl moves CUDA tensors, gloo CPU ones: MPS (and CUDA without nccl) go through one
        # CPU buffer.
        if tensor.device.type == "cuda" and self.moves_cuda:
            return tensor.device
        return torch.device("cpu")

    def _exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Post sending ``send`` to ``dst`` and receiving ``recv`` from ``src``, without
        waiting: the requests go to :attr:`_sends` and :attr:`_receives`. Messages between
        two ranks match in the order they are posted, so both sides post in one order."""
        self._post_send(send, dst)
        self._post_receive(recv, src)

    def _post_send(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends.append(dist.isend(tensor, dst, group=self.group))
        self._finished_bytes += tensor.nbytes  # held by the request until it is retired

    def _post_receive(self, tensor: torch.Tensor, src: int) -> None:
        self._receives.append(dist.irecv(tensor, src, group=self.group))
        self._finished_bytes += tensor.nbytes

    def _exchange_now(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Send ``send`` to ``dst`` and receive ``recv`` from ``src``, and wait for both.

        One batch (``batch_isend_irecv``): nccl runs a send and a receive posted apart one
        after the other, so two peers that send to each other first (a ring of two) would
        each wait for the other's receive; in one group they run together. gloo runs them
        as posted, as :meth:`_exchange` would."""
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, self.group),
                                           dist.P2POp(dist.irecv, recv, src, self.group)])
        self._finished_bytes += send.nbytes + recv.nbytes
        self._sends += requests
        self._settle()

    def _settle(self) -> None:
        """Wait for every posted send and receive not yet waited for (gloo's wait may be
        called once per request: a second wait would wait for another message), then
        retire every request this call waited for."""
        posted = self._sends + self._receives
        self._sends, self._receives = [], []
        for request in posted:
            request.wait()
        self._finished += posted
        self._retire()

    def _retire(self) -> None:
        """Keep the requests finished since the last call alive until the next call, and
        let the ones kept before go now.

        A gloo request freed right after its wait spins (``sched_yield``) in its buffer's
        destructor until gloo's network thread lets the buffer go, which it does only at
        its next event, typically the peer's next message. Collectives back to back (a
        strategy that all-reduces tensor by tensor) then paid about 2 ms per exchange on
        loopback whatever its size; freed one call later, the buffers are long released
        (2 processes, 256 KiB all-reduces back to back: 0.7 ms each instead of 4.2 ms;
        ``python benchmarks/collective.py --back-to-back``). A request holds its tensor, so
        only up to :data:`RETIRED_BYTES` are kept: a large message's transfer dwarfs the
        wait, and a model-sized buffer must not outlive its collective."""
        keep = self._finished_bytes <= RETIRED_BYTES
        self._retired, self._finished = (self._finished if keep else []), []
        self._finished_bytes = 0

    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp, members: list[int]) -> torch.Tensor:
        if flat.device.type != "cpu":  # a CUDA tensor, on nccl
            return self._ring_all_reduce_stepwise(flat, op, members)
        g = len(members)
        if g == 2 == self.group_size and op != "max":
            # With two members each element of the sum is one addition, and a + b == b + a
            # bit for bit: gloo's own all-reduce gives the ring's result, in one C++ call
            # instead of a Python loop of exchanges (on loopback, 4 MB: ~1.5x faster). Not
            # for max: gloo's max need not propagate a NaN as torch.maximum does.
            self._sum_over_group(flat)
            if op == "mean":
                flat.div_(g)
            return flat
        pos = members.index(self.rank)
        nxt, prv = members[(pos + 1) % g], members[(pos - 1) % g]
        # In place: every chunk, and every piece of it, is a view into ``flat``. A step of
        # the ring moves one chunk as pieces, so a piece is added (and sent on) while the
        # next one is still arriving. Every chunk is cut into the same number of pieces (the
        # largest chunk's count), so the pieces sent and received in one exchange share an index.
        chunks = flat.tensor_split(g)
        count = max(1, -(-chunks[0].numel() * flat.element_size() // PIECE_BYTES))
        pieces = [list(c.tensor_split(count)) for c in chunks]
        # Reduce-scatter step s receives chunk pos-s-1 into scratch space, one buffer per
        # step (a piece of the next step may arrive before this step's last is added).
        scratch = self._scratch_space(chunks[0], g - 1)

        def receive_into(step: int) -> list[torch.Tensor]:
            if step < g - 1:  # reduce-scatter
                c = (pos - step - 1) % g
                return list(scratch[step][: chunks[c].numel()].tensor_split(count))
            # All-gather step s receives the finished chunk pos-s straight into ``flat``:
            # the peer sends it only after the whole ring, this node included, has sent
            # that chunk's contributions on, so this node no longer reads that memory.
            return pieces[(pos - (step - (g - 1))) % g]

        steps = 2 * (g - 1)
        targets = [receive_into(0)]
        received: list[Any] = []
        for m, piece in enumerate(pieces[pos]):
            self._exchange(piece, nxt, targets[0][m], prv)
            received.append(self._receives.pop())
        for s in range(steps):
            c = (pos - s - 1) % g
            if s + 1 < steps:
                targets.append(receive_into(s + 1))
            arrivals, received = received, []
            for m, request in enumerate(arrivals):
                request.wait()
                self._finished.append(request)
                if s < g - 1:
                    # The piece holds ((x[c] + ...) + x[pos-1]) and a + b == b + a bit for
                    # bit, so adding it into ours continues the ring order of ring_reduce.
                    _combine_(pieces[c][m], targets[s][m], op)
                if s + 1 < steps:  # piece m of chunk c moves on at once
                    self._exchange(pieces[c][m], nxt, targets[s + 1][m], prv)
                    received.append(self._receives.pop())
        self._settle()
        if op == "mean":
            flat.div_(g)
        return flat

    def _scratch_space(self, like: torch.Tensor, count: int) -> list[torch.Tensor]:
        """``count`` buffers shaped like ``like``. Up to :data:`KEPT_SCRATCH_BYTES` they are
        kept for the next call: fresh memory of that size comes from the kernel page by page,
        which took a third of a 64 MB all-reduce on loopback. One ring runs at a time per
        communicator (a node's thread posts nothing while a bucket is in flight)."""
        need = count * like.numel()
        if need * like.element_size() > KEPT_SCRATCH_BYTES:
            return [torch.empty_like(like) for _ in range(count)]
        kept = self._scratch
        if kept.dtype != like.dtype or kept.device != like.device or kept.numel() < need:
            self._scratch = torch.empty(need, dtype=like.dtype, device=like.device)
        return list(self._scratch[:need].view(count, like.numel()).unbind())

    def _ring_all_reduce_stepwise(self, flat: torch.Tensor, op: ReduceOp, members: list[int]) -> torch.Tensor:
        """The ring one whole chunk at a time (nccl: its point-to-point calls are blocking
        on their stream, so receives cannot all be posted ahead)."""
        g = len(members)
        pos = members.index(self.rank)
        nxt, prv = members[(pos + 1) % g], members[(pos - 1) % g]
        chunks = list(flat.clone().tensor_split(g))
        # Reduce-scatter: after g-1 steps this node holds the full chunk pos+1.
        for s in range(g - 1):
            send_c, recv_c = (pos - s) % g, (pos - s - 1) % g
            incoming = torch.empty_like(chunks[recv_c])
            self._exchange_now(chunks[send_c].contiguous(), nxt, incoming, prv)
            # incoming holds ((x[c] + ...) + x[pos-1]); adding ours continues the ring order.
            _combine_(incoming, chunks[recv_c], op)
            chunks[recv_c] = incoming
        # All-gather the reduced chunks round the ring.
        for s in range(g - 1):
            send_c, recv_c = (pos + 1 - s) % g, (pos - s) % g
            incoming = torch.empty_like(chunks[recv_c])
            self._exchange_now(chunks[send_c].contiguous(), nxt, incoming, prv)
            chunks[recv_c] = incoming
        result = torch.cat(chunks)
        if op == "mean":
            result.div_(g)
        return result

    def _all_gather(self, flat: torch.Tensor, members: list[int]) -> list[torch.Tensor]:
        g = len(members)
        pos = members.index(self.rank)
        nxt, prv = members[(pos + 1) % g], members[(pos - 1) % g]
        blocks: list[torch.Tensor | None] = [None] * g
        blocks[pos] = flat.clone()
        for s in range(g - 1):
            send_b, recv_b = (pos - s) % g, (pos - s - 1) % g
            incoming = torch.empty_like(flat)
            self._exchange_now(blocks[send_b], nxt, incoming, prv)  # type: ignore[arg-type]
            blocks[recv_b] = incoming
        return blocks  # type: ignore[return-value]

    def _broadcast(self, flat: torch.Tensor, src: int, members: list[int]) -> torch.Tensor:
        if self.rank == src:
            for m in members:
                if m != src:
                    self._post_send(flat, m)
            self._settle()
            return flat
        out = torch.empty_like(flat)
        self._post_receive(out, src)
        self._settle()
        return out



#: Bytes per ring message (at most): small enough that adding one piece overlaps with the
#: transfer of the next, large enough that few messages to one peer are in flight at once:
#: gloo then stalls for ~3 ms now and then (measured on loopback, benchmarks/collective.py:
#: 1.68 MB took 3.75-3.94 ms in 512 KiB pieces, 1.29-3.47 ms in 2 MiB ones).
PIECE_BYTES = 2 * 2**20

#: The most bytes of tensors that finished requests keep alive until the next collective
#: (:meth:`TorchDistCommunicator._retire`).
RETIRED_BYTES = 16 * 2**20

#: The most receive space a ring keeps between calls (per node): enough for a 128 MB
#: message between 2 nodes; larger messages take fresh memory each time.
KEPT_SCRATCH_BYTES = 64 * 2**20


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend of a rank training on ``device``.

    gloo moves CPU tensors (MPS ones go through a CPU buffer). On CUDA, nccl moves the CUDA
    tensors, and gloo the CPU ones every run sends besides: the non-finite vote, the
    progress numbers, the weight hashes and each node's report (nccl alone refuses a CPU
    tensor, so a run of two or more CUDA ranks stopped at the first of them)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float = 1800.0,
    *,
    external_store: bool = False,
) -> None:
    """Join the TCP rendezvous at ``master_addr:master_port`` (:func:`backend_for` ``device``).

    By default rank 0 hosts the rendezvous store. With ``external_store`` every rank is a
    client of a store someone else hosts (the processes runtime's parent, bound to
    loopback only: see :func:`host_loopback_store`).
    """
    backend = backend_for(device)
    timeout = timedelta(seconds=timeout_s)
    secret = rendezvous.take_secret()
    if secret is not None:  # under `meshtrain launch`: only proven ranks reach the store
        if rank == 0:
            store, store_port = host_loopback_store(timeout_s)
            listener: rendezvous.Gate | rendezvous.Tunnel = rendezvous.Gate(
                master_addr, master_port, store_port, secret, admissions=world_size - 1,
                peers=rendezvous.peers_from_env())
        else:
            listener = rendezvous.Tunnel(master_addr, master_port, secret, timeout_s)
            store = dist.TCPStore("127.0.0.1", listener.port, is_master=False, timeout=timeout)
        try:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        finally:
            # The group has formed (gloo meets every peer through the store before this
            # returns): the store connections are open, so stop listening for new ones.
            listener.close()
        # gloo's listener (and rank 0's loopback store) cannot be closed, but nobody needs
        # a new connection to them now: from here on they drop every one (see sealing.py).
        sealing.seal_listening_sockets()
        return
    if external_store:
        store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        return
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def host_loopback_store(timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A rendezvous store listening on 127.0.0.1 only, at a free port: (store, port).

    torch's own store listens on every interface; a simulation needs nothing beyond
    loopback, so we bind the socket ourselves and hand it over (the store owns it and
    closes it when it is deleted).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.detach(),
                          wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store, port


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), for gloo."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


#: The store counter of ranks that have left (:func:`leave_in_order`), and the key the last
#: of them sets, which rank 0 waits for.
LEFT_KEY = "meshtrain/left"
ALL_LEFT_KEY = "meshtrain/all-left"

#: How long rank 0 waits for its peers to leave before it leaves anyway (a peer that died
#: never says so).
LEAVE_GRACE_S = 60.0


def leave_in_order(rank: int, world: int, timeout_s: float) -> None:
    """Tear the group down with rank 0 last.

    Rank 0 may host the rendezvous store: if it exits while a peer is still tearing down
    (which talks to the store), the peer's store client fails in a background thread and
    the process aborts ("terminate called without an active exception"). So every other
    rank says through the store when it has left, and rank 0 waits for the last of them
    (the store wakes it: no polling) before it leaves. Its own group it tears down
    meanwhile (gloo takes ~20-40 ms to): the store lives on as long as ``store`` holds it.
    """
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    if rank != 0:
        say_left(store, world)
    elif world > 1:
        # A peer that never says it left (it died) is not waited for beyond the grace.
        with contextlib.suppress(dist.DistStoreError):
            store.wait([ALL_LEFT_KEY], timedelta(seconds=min(timeout_s, LEAVE_GRACE_S)))


def say_left(store: dist.Store, world: int) -> None:
    """A rank other than 0 tells rank 0 it has left: the last thing it sends (the last of
    the ``world - 1`` to leave also wakes rank 0).

    Rank 0 may exit, closing the store, before the store's reply reaches this rank; the
    call then fails here with the connection closed. The rank has nothing left to do
    either way (training ended at a barrier every rank passed), so that failure is not
    this rank's: it leaves normally."""
    with contextlib.suppress(dist.DistNetworkError):
        if store.add(LEFT_KEY, 1) == world - 1:
            # add, not set: torch's client sends a set and returns without an answer, and a
            # launched rank's store traffic passes through its tunnel's relay thread
            # (comm/rendezvous.py), which dies with the process. A set still in the relay
            # when this rank exited never reached rank 0, which then waited out
            # LEAVE_GRACE_S (60 s at the end of launches on a busy machine). add returns
            # once the store has the key.
            store.add(ALL_LEFT_KEY, 1)
