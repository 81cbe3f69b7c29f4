"""Seeds every node derives the same way, so shared random choices need no messages."""

from __future__ import annotations

import torch


def mix_seed(*keys: int) -> int:
    """A stable 63-bit seed from integer keys, e.g. (run seed, step, tensor index)."""
    mixed = 0x2545F4914F6CDD1D
    for k in keys:
        mixed = (mixed * 6364136223846793005 + k + 1442695040888963407) % (1 << 63)
    return mixed


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by :func:`mix_seed` of the keys."""
    return torch.Generator().manual_seed(mix_seed(*keys))



# torch draws a model's random numbers (dropout) from the default generator of the device
# the computation runs on: the CPU's, and on a GPU that GPU's own. A node's random stream is
# both, keyed by device type, so that it is the same wherever the node runs (a thread or a
# process) and continues after a resume.
RandomState = dict[str, torch.Tensor]
ACCELERATORS = ("cuda", "mps")


def seeded_state(seed: int, device: torch.device) -> RandomState:
    """The state ``torch.manual_seed(seed)`` gives the generators a node on ``device`` draws from."""
    state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if device.type in ACCELERATORS:
        state[device.type] = torch.Generator(device=device).manual_seed(seed).get_state()
    return state


def current_state(device: torch.device) -> RandomState:
    """The global generators' state, for a node on ``device`` (see :func:`seeded_state`)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_state(state: RandomState | torch.Tensor, device: torch.device) -> None:
    """Put ``state`` (from :func:`current_state`; a lone tensor is the CPU's alone, as older
    checkpoints hold it) back into the global generators. A run resumed on another kind of
    device starts that device's stream from where torch's generator is."""
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])
