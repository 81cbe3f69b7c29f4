"""A node's state sent to the nodes that rejoin an elastic run, without pickle.

A state is what ``state_dict`` methods return: dicts (string or integer keys), lists,
tuples, tensors, numbers, strings, True/False/None. It travels as two things: a JSON
*skeleton* of the structure, each tensor replaced by its place, dtype and shape, and the
tensors themselves, one flat buffer per dtype. The receiver rebuilds the structure from
the skeleton alone: a peer can send data, never code, and every field is checked.

:func:`send_state` and :func:`receive_state` run over a :class:`Communicator` group of
the source and the joiners (a broadcast from the source); they return the bytes the
source sent per receiver (the healing cost).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from meshtrain.comm.communicator import Communicator
from meshtrain.errors import RunFailure

#: Most bytes of a skeleton (a state's structure, not its tensors).
MAX_SKELETON_BYTES = 64 << 20
#: Tensor dtypes a state may hold, by name (the names the skeleton carries).
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


class StateTransferError(RunFailure):
    """What a peer sent is not a state this node can take."""


def encode(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors) of ``state``: the skeleton is JSON-able and names each tensor's
    index into the list."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise StateTransferError(f"a state tensor of dtype {name} cannot be sent")
            tensors.append(value.detach().to("cpu").contiguous())
            return {"t": len(tensors) - 1, "dtype": name, "shape": list(value.shape)}
        if isinstance(value, dict):
            return {"d": [[walk_key(k), walk(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return {"l" if isinstance(value, list) else "u": [walk(v) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"v": value}
        raise StateTransferError(f"a state holds a {type(value).__name__}, which cannot be sent")

    def walk_key(key: Any) -> Any:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise StateTransferError(f"a state's key {key!r} is neither a string nor a whole number")
        return key

    return walk(state), tensors


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The state from :func:`encode`'s two parts; raises :class:`StateTransferError` on
    anything that is not such a skeleton."""

    def walk(node: Any, depth: int) -> Any:
        if depth > 64 or not isinstance(node, dict) or len(node) not in (1, 3):
            raise StateTransferError("the state's structure is malformed")
        if "t" in node:
            index = node["t"]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise StateTransferError("the state names a tensor it did not send")
            return tensors[index]
        ((kind, value),) = node.items()
        if kind == "v":
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise StateTransferError("the state holds a value of an unknown kind")
            return value
        if kind in ("l", "u") and isinstance(value, list):
            items = [walk(v, depth + 1) for v in value]
            return items if kind == "l" else tuple(items)
        if kind == "d" and isinstance(value, list):
            out: dict[Any, Any] = {}
            for pair in value:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (int, str))
                        and not isinstance(pair[0], bool)):
                    raise StateTransferError("the state holds a malformed dictionary")
                out[pair[0]] = walk(pair[1], depth + 1)
            return out
        raise StateTransferError(f"the state holds an item of unknown kind {kind!r}")

    return walk(skeleton, 0)


def _placeholders(skeleton: Any) -> list[torch.Tensor]:
    """Empty tensors shaped as the skeleton names them, in order (receive buffers)."""
    found: dict[int, torch.Tensor] = {}

    def walk(node: Any, depth: int) -> None:
        if depth > 64 or not isinstance(node, dict):
            raise StateTransferError("the state's structure is malformed")
        if "t" in node:
            dtype, shape = node.get("dtype"), node.get("shape")
            if dtype not in DTYPES or not isinstance(shape, list) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise StateTransferError("the state names a tensor of unknown dtype or shape")
            found[node["t"]] = torch.empty(shape, dtype=DTYPES[dtype])
            return
        for value in node.values():
            if isinstance(value, list):
                for item in value:
                    if isinstance(item, list) and len(item) == 2:
                        walk(item[1], depth + 1)
                    elif isinstance(item, dict):
                        walk(item, depth + 1)

    walk(skeleton, 0)
    if sorted(found) != list(range(len(found))):
        raise StateTransferError("the state's tensors are not numbered in order")
    return [found[i] for i in range(len(found))]


def send_state(comm: Communicator, state: Any, group: list[int]) -> int:
    """Broadcast ``state`` from this node to the rest of ``group``; the bytes sent to each."""
    skeleton, tensors = encode(state)
    text = json.dumps(skeleton, allow_nan=True).encode()
    if len(text) > MAX_SKELETON_BYTES:
        raise StateTransferError(f"the state's structure takes {len(text)} bytes, over {MAX_SKELETON_BYTES}")
    length = torch.tensor([len(text)], dtype=torch.int64)
    comm.broadcast(length, src=comm.rank, group=group, record=False)
    comm.broadcast(torch.frombuffer(bytearray(text), dtype=torch.uint8), src=comm.rank, group=group,
                   record=False)
    if tensors:
        comm.broadcast(tensors, src=comm.rank, group=group, record=False)
    return len(text) + 8 + sum(t.nbytes for t in tensors)


def receive_state(comm: Communicator, source: int, group: list[int]) -> tuple[Any, int]:
    """The state ``source`` broadcasts to ``group`` (this node among them), and its bytes."""
    length = torch.zeros(1, dtype=torch.int64)
    comm.broadcast(length, src=source, group=group, record=False)
    size = int(length.item())
    if not 0 < size <= MAX_SKELETON_BYTES:
        raise StateTransferError(f"rank {source} announced a state structure of {size} bytes")
    text = torch.zeros(size, dtype=torch.uint8)
    comm.broadcast(text, src=source, group=group, record=False)
    try:
        skeleton = json.loads(bytes(text.tolist()).decode())
    except (ValueError, UnicodeDecodeError):
        raise StateTransferError(f"rank {source} sent a state structure that is not JSON") from None
    tensors = _placeholders(skeleton)
    if tensors:
        comm.broadcast(tensors, src=source, group=group, record=False)
    return decode(skeleton, tensors), size + 8 + sum(t.nbytes for t in tensors)
