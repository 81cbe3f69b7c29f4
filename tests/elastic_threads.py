"""In-process elastic runs: members as threads of this process, gloo over loopback."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from meshtrain.comm.torch_dist import loopback_interface


def on_threads(*work: Any) -> None:
    """Run each callable on a thread of its own (one member each) and fail with what any raised."""
    errors: list[BaseException] = []

    def run(w: Any) -> None:
        try:
            w()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


@pytest.fixture(name="loopback")
def loopback_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo on the loopback interface (skips, saying so, where there is none)."""
    iface = loopback_interface()
    if iface is None:
        pytest.skip("no loopback interface for gloo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", iface)
