"""Streaming DiLoCo and DiLoCo's delayed outer step against plain-PyTorch references written
from the papers (arXiv 2501.18512; arXiv 2502.12996), in the style of test_reference_math.py:
one model copy per node, torch optimizers, no meshtrain helpers."""

from __future__ import annotations

import pytest
import torch
from helpers import MLP, assert_states_equal, regression_data
from test_reference_math import assert_params_close, assert_params_differ, fit, sharded_batch

from meshtrain.strategies import DiLoCo, StreamingDiLoCo
from meshtrain.strategies.streaming_diloco import split_fragments


def _inner(models, lr):
    return [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
            for m in models]


def _train_step(models, inner, data, nodes, s, batch):
    for r, (m, opt) in enumerate(zip(models, inner, strict=True)):
        opt.zero_grad()
        m(sharded_batch(data, r, nodes, s, batch)).backward()
        opt.step()


def _node_params(models, i):
    return [list(m.parameters())[i] for m in models]


# ------------------------------------------------------------------------ Streaming DiLoCo
def reference_streaming(data, nodes, steps, batch, *, H, F, tau, alpha, fragments, inner_lr,
                        outer_lr, momentum) -> list[torch.Tensor]:
    """Streaming DiLoCo, plain torch. Fragment p (its tensor indices ``fragments[p]``, an
    input here) syncs after the steps s with s + 1 = (p + 1) * H // F + k * H: its outer
    gradient theta_p - mean_i(theta_i,p) is taken then, and tau steps later (the all-reduce
    overlapping them) theta_p takes one outer Nesterov step on it and every node's fragment
    becomes alpha * local + (1 - alpha) * theta_p. After the last step: pending merges, then
    every fragment that trained since its sync began (or mixed with alpha > 0) syncs with
    replacement."""
    models = [MLP() for _ in range(nodes)]
    inner = _inner(models, inner_lr)
    theta = [p.detach().clone().requires_grad_(True) for p in MLP().parameters()]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=momentum, nesterov=True)
    pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
    started = [-1] * F

    def outer_gradient(indices):
        return [theta[i].detach() - torch.stack([p.detach() for p in _node_params(models, i)]).mean(0)
                for i in indices]

    def apply(indices, grads, a):
        for i, g in zip(indices, grads, strict=True):
            theta[i].grad = g
        outer.step()
        with torch.no_grad():
            for i in indices:
                theta[i].grad = None
                for p in _node_params(models, i):
                    p.copy_(a * p + (1 - a) * theta[i])

    for s in range(steps):
        _train_step(models, inner, data, nodes, s, batch)
        for p in range(F):
            offset = (p + 1) * H // F
            if s + 1 >= offset and (s + 1 - offset) % H == 0:
                pending[p] = (s + tau, outer_gradient(fragments[p]))
                started[p] = s
        for p in sorted(pending):
            if pending[p][0] == s:
                apply(fragments[p], pending.pop(p)[1], alpha)
    for p in sorted(pending):
        apply(fragments[p], pending[p][1], alpha)
    last = [i for p in range(F) if started[p] != steps - 1 or alpha != 0 for i in fragments[p]]
    if last:
        apply(last, outer_gradient(last), 0.0)
    return [t.detach() for t in theta]


def test_fragments_are_contiguous_runs_of_about_equal_bytes():
    # The MLP's tensors: fc1.weight 48, fc1.bias 8, fc2.weight 16, fc2.bias 2 elements.
    assert split_fragments([48, 8, 16, 2], 1) == [[0, 1, 2, 3]]
    assert split_fragments([48, 8, 16, 2], 2) == [[0], [1, 2, 3]]
    assert split_fragments([48, 8, 16, 2], 4) == [[0], [1], [2], [3]]
    assert split_fragments([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="fragments must be between 1 and the 4"):
        split_fragments([48, 8, 16, 2], 5)


@pytest.mark.parametrize(("F", "H", "tau", "alpha", "steps"), [
    (2, 4, 1, 0.5, 11),  # overlapped, mixed; 11: merges still pending at the end
    (3, 6, 2, 0.0, 12),  # replaced; the last fragment starts at the last step
    (2, 4, 0, 0.5, 9),   # no overlap
])
def test_streaming_diloco_matches_the_reference(F, H, tau, alpha, steps, tmp_path):
    nodes, batch = 3, 4
    data = regression_data(nodes * batch * steps)
    strategy = StreamingDiLoCo(fragments=F, H=H, tau=tau, alpha=alpha, lr=0.01)
    result = fit(MLP(), data, strategy, tmp_path, nodes=nodes, max_steps=steps, batch_size=batch)
    fragments = {2: [[0], [1, 2, 3]], 3: [[0], [1], [2, 3]]}[F]
    expected = reference_streaming(data, nodes, steps, batch, H=H, F=F, tau=tau, alpha=alpha,
                                   fragments=fragments, inner_lr=0.01, outer_lr=0.7, momentum=0.9)
    assert_params_close(result.model, expected)


def test_streaming_diloco_with_one_fragment_no_overlap_and_replacement_is_diloco(tmp_path):
    nodes, batch, steps, H = 3, 4, 10, 3
    data = regression_data(nodes * batch * steps)
    kwargs = dict(nodes=nodes, max_steps=steps, batch_size=batch)
    streaming = fit(MLP(), data, StreamingDiLoCo(fragments=1, H=H, tau=0, alpha=0.0, lr=0.01),
                    tmp_path / "s", **kwargs)
    diloco = fit(MLP(), data, DiLoCo(H=H, lr=0.01), tmp_path / "d", **kwargs)
    assert_states_equal(streaming.model, diloco.model)


def test_streaming_diloco_sends_one_fragment_per_sync(tmp_path):
    nodes, batch, steps = 2, 4, 8
    data = regression_data(nodes * batch * steps)
    result = fit(MLP(), data, StreamingDiLoCo(fragments=2, H=4, tau=1, lr=0.01), tmp_path,
                 nodes=nodes, max_steps=steps, batch_size=batch)
    sent = {row["step"]: row["bytes_sent"] for row in result.history}
    # A ring all-reduce of S bytes between 2 nodes sends S: fragment 0 (fc1.weight, 48 floats)
    # syncs after steps 1 and 5, fragment 1 (the other 26) after step 3; nothing else moves.
    # Bytes count at the step a sync starts, in every runtime; rows count from 1.
    assert [sent[s + 1] for s in range(1, 7)] == [48 * 4, 0, 26 * 4, 0, 48 * 4, 0]


@pytest.mark.parametrize("bad", [dict(fragments=0), dict(fragments=5, H=4), dict(tau=4, H=4),
                                 dict(alpha=1.5), dict(alpha=float("nan"))])
def test_streaming_diloco_refuses_bad_settings(bad):
    with pytest.raises(ValueError):
        StreamingDiLoCo(**bad)


# ------------------------------------------------------------------------ DiLoCo, delay=1
def reference_delayed_diloco(data, nodes, steps, batch, *, H, inner_lr, outer_lr,
                             momentum) -> list[torch.Tensor]:
    """DiLoCo with one round of delay, plain torch. Node r keeps a_r, its parameters when
    the round began. At a round's end it takes d_r = a_r - theta_r; the mean of the previous
    round's d (if any) steps theta (outer Nesterov SGD) and theta_r = theta - d_r; then
    a_r = theta_r and this round's mean waits for the next round's end. After the last
    step: the pending mean steps theta, then the mean of the progress since the last round
    end (if any step ran since) steps theta, and every node takes theta."""
    models = [MLP() for _ in range(nodes)]
    inner = _inner(models, inner_lr)
    theta = [p.detach().clone().requires_grad_(True) for p in MLP().parameters()]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=momentum, nesterov=True)
    anchors = [[p.detach().clone() for p in m.parameters()] for m in models]
    waiting: list[torch.Tensor] | None = None

    def step_theta(mean_progress):
        for t, g in zip(theta, mean_progress, strict=True):
            t.grad = g
        outer.step()
        for t in theta:
            t.grad = None

    def progress():
        return [[a - p.detach() for a, p in zip(anchors[r], m.parameters(), strict=True)]
                for r, m in enumerate(models)]

    def mean_of(per_node):
        return [torch.stack(ts).mean(0) for ts in zip(*per_node, strict=True)]

    last_round_end = -1
    for s in range(steps):
        _train_step(models, inner, data, nodes, s, batch)
        if (s + 1) % H == 0:
            d = progress()
            with torch.no_grad():
                if waiting is not None:
                    step_theta(waiting)
                    for r, m in enumerate(models):
                        for p, t, dr in zip(m.parameters(), theta, d[r], strict=True):
                            p.copy_(t - dr)
                anchors = [[p.detach().clone() for p in m.parameters()] for m in models]
            waiting = mean_of(d)
            last_round_end = s
    with torch.no_grad():
        d = progress() if last_round_end != steps - 1 else None
        if waiting is not None:
            step_theta(waiting)
        if d is not None:
            step_theta(mean_of(d))
    return [t.detach() for t in theta]


@pytest.mark.parametrize("steps", [12, 14])  # 14: a short last round after the pending mean
def test_diloco_delay_one_matches_the_reference(steps, tmp_path):
    nodes, batch, H = 3, 4, 3
    data = regression_data(nodes * batch * steps)
    result = fit(MLP(), data, DiLoCo(H=H, lr=0.01, delay=1), tmp_path, nodes=nodes,
                 max_steps=steps, batch_size=batch)
    expected = reference_delayed_diloco(data, nodes, steps, batch, H=H, inner_lr=0.01,
                                        outer_lr=0.7, momentum=0.9)
    assert_params_close(result.model, expected)
    undelayed = fit(MLP(), data, DiLoCo(H=H, lr=0.01), tmp_path / "plain", nodes=nodes,
                    max_steps=steps, batch_size=batch)
    assert_params_differ(result.model, [p.detach() for p in undelayed.model.parameters()])


def test_diloco_refuses_a_delay_other_than_zero_or_one():
    with pytest.raises(ValueError, match="delay must be 0 or 1"):
        DiLoCo(delay=2)


def test_the_summary_shows_peak_bytes_per_sync_beside_the_total(tmp_path):
    nodes, batch, steps = 2, 4, 9
    data = regression_data(nodes * batch * steps)
    kwargs = dict(nodes=nodes, max_steps=steps, batch_size=batch)
    streaming = fit(MLP(), data, StreamingDiLoCo(fragments=2, H=4, tau=1, lr=0.01), tmp_path / "s",
                    **kwargs)
    diloco = fit(MLP(), data, DiLoCo(H=4, lr=0.01), tmp_path / "d", **kwargs)
    # 2 nodes: a ring all-reduce of S bytes sends S. DiLoCo's syncs move all 74 floats;
    # streaming's largest fragment is fc1.weight (48). The final syncs (step 9) are left out.
    assert diloco.summary["peak_bytes_sent_per_sync"] == 74 * 4
    assert streaming.summary["peak_bytes_sent_per_sync"] == 48 * 4
    assert streaming.summary["bytes_sent_per_node"] > streaming.summary["peak_bytes_sent_per_sync"]


def test_a_fragment_sync_is_recorded_as_running_beside_the_next_tau_steps(tmp_path):
    nodes, batch, steps = 2, 4, 8
    data = regression_data(nodes * batch * steps)
    # Projected on Wi-Fi, part of each sync hides behind the steps it runs beside.
    for strategy in (StreamingDiLoCo(fragments=2, H=4, tau=3, lr=0.01), DiLoCo(H=4, lr=0.01, delay=1)):
        result = fit(MLP(), data, strategy, tmp_path / strategy.name, nodes=nodes, max_steps=steps,
                     batch_size=batch, cluster="wifi")
        projected = result.summary["projected"]
        assert projected["overlapped_seconds"] > 0, strategy


def test_the_gpt_models_fragments_each_hold_about_a_quarter_of_it():
    from meshtrain.tasks.gpt import CharGPT

    sizes = [p.numel() * 4 for p in CharGPT(100, 64, 2, 4, 64, 0.0).parameters()]
    fragments = split_fragments(sizes, 4)
    assert [i for f in fragments for i in f] == list(range(len(sizes)))  # contiguous, in order
    # Cut at whole tensors where the running total comes nearest to k/4 (the largest tensor,
    # the MLP's 64x256 weight, is 15% of the model): the largest fragment is 30%, not 25%.
    assert max(sum(sizes[i] for i in f) for f in fragments) <= 0.31 * sum(sizes)
