"""Asynchronous DiLoCo (arXiv 2401.09135) against a plain-PyTorch reference written from the
paper: dynamic local updates (Eq. 6), delayed Nesterov (Algorithm 3), and the asynchronous
task scheduling of Algorithm 2 on a clock simulated from the workers' speeds (the schedule
meshtrain/strategies/async_diloco.py documents)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import MLP, regression_data
from test_reference_math import (
    assert_params_close,
    assert_params_differ,
    fit,
    reference_diloco,
    sharded_batch,
)

from meshtrain.strategies import STRATEGIES, DiLoCo
from meshtrain.strategies.async_diloco import AsyncDiLoCo, DelayedNesterov, Timeline


def reference_async_diloco(data, nodes, steps, batch, *, speeds, H, dylu=True, grace=None,
                           inner_lr, outer_lr=0.7, beta=0.9, N=None, c=0.0) -> list[torch.Tensor]:
    """Async. DiLoCo with DN + DyLU, plain torch. Time counts steps of the fastest worker; loop
    step L is [L, L+1). Worker r (relative speed s_r) runs the j-th inner step of a job begun
    at b when b + j/s_r falls in the loop step, and its update arrives at b + n_r/s_r. The
    first arrival (rounded to its loop step) opens a group that closes ``grace`` loop steps
    later or once every worker has arrived; its updates are applied one by one in order of
    arrival (then rank) with Algorithm 3, and its workers restart from theta at the next loop
    step. At the end every worker's unsent progress is applied in the order its last inner step
    ended."""
    fastest = max(speeds)
    rel = [v / fastest for v in speeds]
    n_steps = [max(1, math.floor(s * H + 1e-9)) if dylu else H for s in rel]  # Eq. 6
    if grace is None:
        grace = max(0, math.ceil(max(1 / s for s in rel) - 1e-9) - 1)
    N = N or nodes
    models = [MLP() for _ in range(nodes)]
    inner = [torch.optim.AdamW(m.parameters(), lr=inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
             for m in models]
    theta = [p.detach().clone() for p in MLP().parameters()]
    start_of_job = [[t.clone() for t in theta] for _ in range(nodes)]
    m = [torch.zeros_like(t) for t in theta]
    buffer = [torch.zeros_like(t) for t in theta]
    t_server = 0
    begun = [0] * nodes
    taken = [0] * nodes  # inner steps of the current job done
    batches_read = [0] * nodes
    last_end = [None] * nodes

    def server_update(g):  # Algorithm 3
        nonlocal t_server
        for i in range(len(theta)):
            buffer[i] += g[i]
            if (t_server + 1) % N == 0:
                m[i] = beta * m[i] + buffer[i] / N
                theta[i] = theta[i] - outer_lr * ((1 - c * N + c) * beta * m[i] + g[i] / N)
                buffer[i] = torch.zeros_like(buffer[i])
            else:
                theta[i] = theta[i] - outer_lr * (c * beta * m[i] + g[i] / N)
        t_server += 1

    def send(r):
        server_update([a - p.detach() for a, p in zip(start_of_job[r], models[r].parameters(), strict=True)])

    def restart(r, at):
        with torch.no_grad():
            for p, t in zip(models[r].parameters(), theta, strict=True):
                p.copy_(t)
        start_of_job[r] = [t.clone() for t in theta]
        begun[r], taken[r], last_end[r] = at, 0, None

    arrival = [lambda r=r: begun[r] + n_steps[r] / rel[r] for r in range(nodes)]
    for L in range(steps):
        for r in range(nodes):
            if taken[r] < n_steps[r] and math.floor(begun[r] + taken[r] / rel[r] + 1e-9) == L:
                inner[r].zero_grad()
                models[r](sharded_batch(data, r, nodes, batches_read[r], batch)).backward()
                inner[r].step()
                batches_read[r] += 1
                taken[r] += 1
                last_end[r] = begun[r] + taken[r] / rel[r]
        arrived = [r for r in range(nodes) if math.ceil(arrival[r]() - 1e-9) - 1 <= L]
        if arrived:
            opened = min(math.ceil(arrival[r]() - 1e-9) - 1 for r in arrived)
            if L >= opened + grace or len(arrived) == nodes:
                for r in sorted(arrived, key=lambda r: (arrival[r](), r)):
                    send(r)
                for r in arrived:
                    restart(r, L + 1)
    for r in sorted((r for r in range(nodes) if last_end[r] is not None), key=lambda r: (last_end[r], r)):
        send(r)
    return theta


@pytest.mark.parametrize(("speeds", "options", "steps"), [
    ([1.0, 1 / 3], {}, 20),  # DyLU 6 and 2 steps, one group a round; 20: a cut last round
    ([1.0, 0.5, 0.4], {"dylu": False, "grace": 0, "buffer_size": 2, "momentum_activation": 0.25}, 17),
])
def test_async_diloco_matches_the_reference(speeds, options, steps, tmp_path):
    nodes, batch, H, lr = len(speeds), 4, 6, 0.01
    data = regression_data(nodes * batch * steps)
    strategy = AsyncDiLoCo(H=H, lr=lr, speeds=speeds, **options)
    result = fit(MLP(), data, strategy, tmp_path, nodes=nodes, max_steps=steps, batch_size=batch)
    reference_options = {"dylu": options.get("dylu", True), "grace": options.get("grace"),
                         "N": options.get("buffer_size"), "c": options.get("momentum_activation", 0.0)}
    expected = reference_async_diloco(data, nodes, steps, batch, speeds=speeds, H=H, inner_lr=lr,
                                      **reference_options)
    assert_params_close(result.model, expected)
    # Equal speeds would be another model: the speeds set who trains when.
    assert_params_differ(result.model, reference_async_diloco(
        data, nodes, steps, batch, speeds=[1.0] * nodes, H=H, inner_lr=lr, **reference_options))
    assert result.history[-1]["examples"] < nodes * batch * steps  # slower nodes skipped loop steps


def test_equal_speeds_are_diloco(tmp_path):
    # Every update arrives in one group a round and N = nodes: DN's N updates sum to DiLoCo's
    # outer Nesterov step on their mean.
    nodes, batch, H, steps = 3, 4, 3, 10
    data = regression_data(nodes * batch * steps)
    result = fit(MLP(), data, AsyncDiLoCo(H=H, lr=0.01), tmp_path, nodes=nodes, max_steps=steps,
                 batch_size=batch)
    expected = reference_diloco(data, nodes, steps, batch, H=H, inner_lr=0.01, outer_lr=0.7, momentum=0.9)
    assert_params_close(result.model, expected)


def test_delayed_nesterov_with_a_buffer_of_one_is_torch_nesterov():
    theta = [torch.zeros(5, dtype=torch.float64)]
    server = DelayedNesterov(theta, lr=0.7, momentum=0.9, buffer_size=1, activation=0.0)
    twin = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    sgd = torch.optim.SGD([twin], lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        grad = torch.randn(5, generator=g, dtype=torch.float64)
        server.apply([grad])
        twin.grad = grad
        sgd.step()
    assert torch.equal(theta[0], twin.detach())
    # The paper's worked number: a first update of 1 moves theta by -lr * (1 + beta).
    one = [torch.zeros(1, dtype=torch.float64)]
    DelayedNesterov(one, 0.7, 0.9, 1, 0.0).apply([torch.ones(1, dtype=torch.float64)])
    assert one[0].item() == pytest.approx(-1.33)


def test_dylu_schedule_of_a_node_three_times_slower():
    line = Timeline(2, H=10, dylu=True, grace=None)
    line.set_speeds([1.0, 1 / 3])
    line.restart([0, 1], -1)
    assert line.job_steps == [10, 3]  # Eq. 6: floor(1/3 * 10)
    assert [s for s in range(10) if line.trains(1, s)] == [0, 3, 6]
    assert all(line.trains(0, s) for s in range(10))
    # The slow worker arrives at time 9 (loop step 8); grace 2 holds the group for the fast one.
    assert line.grace == 2
    assert line.closing(8, [0, 1]) == []
    assert line.closing(9, [0, 1]) == [1, 0]  # in order of arrival
    line.restart([0, 1], 9)
    assert [s for s in range(10, 20) if line.trains(1, s)] == [10, 13, 16]


def test_simulated_straggler_sets_the_speeds_and_the_projection(tmp_path):
    nodes, batch, H, steps = 2, 4, 6, 12
    data = regression_data(nodes * batch * steps)
    common = dict(nodes=nodes, max_steps=steps, batch_size=batch, step_seconds=0.01,
                  straggler=["node=1,slowdown=3"])
    run = fit(MLP(), data, AsyncDiLoCo(H=H, lr=0.01), tmp_path / "a", **common)
    given = fit(MLP(), data, AsyncDiLoCo(H=H, lr=0.01, speeds=[3, 1]), tmp_path / "b",
                **{**common, "straggler": []})
    assert_params_close(run.model, [p.detach() for p in given.model.parameters()], rtol=0, atol=0)
    # Node 1 trains 2 of every 6 loop steps: the others are no step of its own.
    assert [row["examples"] for row in run.history[:6]] == [8, 12, 16, 24, 28, 32]
    # Each loop step lasts the fastest node's step: nobody waits for the straggler.
    assert run.summary["projected"]["compute_seconds"] == pytest.approx(steps * 0.01)
    sync = fit(MLP(), data, DiLoCo(H=H, lr=0.01), tmp_path / "c", **common)
    assert sync.summary["projected"]["compute_seconds"] == pytest.approx(3 * steps * 0.01)


@pytest.mark.parametrize(("options", "settings", "message"), [
    ({"speeds": [1, 2, 3]}, {}, "speeds has 3 values for 2 nodes"),
    ({"momentum_activation": 0.6}, {}, "momentum_activation must be in [0, 1/buffer_size]"),
    ({"speeds": [1, "x"]}, {}, "speeds must be a list of numbers > 0"),
    ({"speeds": [1, 2]}, {"straggler": ["node=1,slowdown=2"]}, "give the nodes' speeds once"),
    ({}, {"balance": True}, "in place of --balance's shares of a step's samples: drop --balance"),
])
def test_bad_async_diloco_settings_name_the_value(options, settings, message, tmp_path):
    data = regression_data(32)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fit(MLP(), data, AsyncDiLoCo(H=2, **options), tmp_path, nodes=2, max_steps=4, batch_size=4,
            **settings)


def test_listed_as_a_built_in_strategy():
    assert STRATEGIES["async-diloco"] is AsyncDiLoCo
    wanted = {"H", "dylu", "grace", "buffer_size", "momentum_activation", "speeds"}
    assert wanted <= set(AsyncDiLoCo.parameters())


def test_plan_weighs_async_diloco():
    from meshtrain.cluster import get_cluster
    from meshtrain.planning import Workload, candidates

    found = {c.label: c for c in candidates(Workload(100_000, 0.05, 2), get_cluster("wifi"))}
    mine, sync = found["async-diloco (H=50)"], found["diloco (H=50)"]
    assert "2401.09135" not in mine.quality and "[8]" in mine.quality
    # Its round moves each host's update to the other once: DiLoCo's bytes on 2 hosts.
    assert mine.peak_bytes == sync.peak_bytes
