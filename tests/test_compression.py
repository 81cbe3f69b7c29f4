"""Compressed pseudo-gradient averaging (``compression``) and SparseLoCo, against references.

The references below are written from the definitions (blockwise absmax int8/int4, the
SparseLoCo paper's update, arXiv 2508.15706) with plain torch: one model copy per node,
quantisation by explicit loops over blocks, no meshtrain helpers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import MLP, regression_data
from test_reference_math import sharded_batch
from torch.testing import assert_close

from meshtrain import Trainer
from meshtrain.comm.compression import Codec, SparseCodec
from meshtrain.config.spec import ConfigError
from meshtrain.strategies import STRATEGIES, DiLoCo, FedAvg, SparseLoCo, SPARTADiLoCo

TOL = dict(rtol=1e-5, atol=1e-6)


def fit(strategy, tmp_path, data, **kwargs):
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("progress", False)
    return Trainer(MLP(), data).fit(strategy, out_dir=tmp_path, **kwargs)


# ------------------------------------------------------------------------------ the codecs
def reference_blockwise(x: torch.Tensor, levels: int, block: int) -> torch.Tensor:
    """What a blockwise absmax quantiser carries: per block s = max|x| / levels, each value
    round(x / s) * s (an all-zero block stays zero)."""
    out = torch.zeros_like(x)
    for start in range(0, x.numel(), block):
        piece = x[start : start + block]
        s = piece.abs().max() / levels
        if s > 0:
            out[start : start + block] = torch.clamp(torch.round(piece / s), -levels, levels) * s
    return out


@pytest.mark.parametrize(("name", "levels"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("numel", [1, 127, 300])  # 127, 300: a short last block; odd nibble count
def test_int_codecs_carry_the_blockwise_quantisation(name, levels, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[: min(10, numel)] = 0.0  # a block may start with zeros
    codec = Codec(name, block_size=64)
    payload = codec.encode(x.unsqueeze(0))[0]
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(numel)
    assert_close(codec.decode(payload, numel), reference_blockwise(x, levels, 64), rtol=0, atol=0)


def test_int4_packs_two_values_per_byte_low_nibble_first():
    x = torch.tensor([[7.0, -7.0, 0.0, 1.0, -1.0]])
    payload = Codec("int4", block_size=8).encode(x)[0]
    # one float32 scale (7 / 7 = 1.0), then codes q + 8: (15, 1), (8, 9), (7, pad 8)
    assert payload[:4].clone().view(torch.float32).item() == 1.0
    assert payload[4:].tolist() == [15 | 1 << 4, 8 | 9 << 4, 7 | 8 << 4]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_half_codecs_are_casts(name):
    x = torch.randn(1, 50)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    codec = Codec(name)
    assert codec.payload_bytes(50) == 100
    assert torch.equal(codec.decode(codec.encode(x)[0], 50), x[0].to(dtype).float())


def test_payload_bytes_are_exact_fractions_of_fp32():
    n, block = 10_000, 128
    blocks = math.ceil(n / block)
    assert Codec("fp32").payload_bytes(n) == 4 * n
    assert Codec("int8", block).payload_bytes(n) == n + 4 * blocks  # 1/4 of fp32 + scales
    assert Codec("int4", block).payload_bytes(n) == n // 2 + 4 * blocks  # 1/8 of fp32 + scales
    # SparseLoCo: per 4,096 values one scale, 64 indices of 12 bits, 64 values of 2 bits
    assert SparseCodec(4096, 64).payload_bytes(3 * 4096) == 3 * (4 + 96 + 16)


def test_codec_refuses_unknown_names_and_bad_blocks():
    with pytest.raises(ValueError, match="compression must be one of fp32, bf16, fp16, int8, int4"):
        Codec("int3")
    with pytest.raises(ValueError, match="compression_block must be an integer >= 1"):
        Codec("int8", 0)
    with pytest.raises(ValueError, match="topk must be a multiple of 4"):
        SparseCodec(4096, 62)


def reference_sparse(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """SparseLoCo's Q(TopK(x)): per chunk the k largest |x|, each as (c - 1.5) s with
    s = max|kept| / 1.5, c = clamp(round(v / s + 1.5), 0, 3); the rest zero."""
    padded = torch.cat([x, torch.zeros((-x.numel()) % chunk)])
    out = torch.zeros_like(padded)
    for start in range(0, padded.numel(), chunk):
        piece = padded[start : start + chunk]
        order = sorted(range(chunk), key=lambda i: -abs(piece[i].item()))[:k]
        kept = piece[order]
        s = kept.abs().max() / 1.5
        if s > 0:
            codes = torch.clamp(torch.round(kept / s + 1.5), 0, 3)
            out[start + torch.tensor(order)] = (codes - 1.5) * s
    return out[: x.numel()]


def test_sparse_codec_carries_top_k_in_two_bits_with_twelve_bit_indices():
    x = torch.randn(4096 + 1000, generator=torch.Generator().manual_seed(3))
    codec = SparseCodec(4096, 64)
    payload = codec.encode(x.unsqueeze(0))[0]
    assert payload.numel() == 2 * 116
    decoded = codec.decode(payload, x.numel())
    assert_close(decoded, reference_sparse(x, 4096, 64), rtol=0, atol=0)
    assert int((decoded != 0).sum()) == 128
    # an index above 255 survives the 12-bit packing (the largest value sits at 4000)
    y = torch.zeros(1, 4096)
    y[0, 4000], y[0, 7] = 5.0, -5.0
    back = SparseCodec(4096, 4).decode(SparseCodec(4096, 4).encode(y)[0], 4096)
    assert back[4000] == 5.0 and back[7] == -5.0


# --------------------------------------------------------------- DiLoCo with compression
def local_rounds(models, inner, data, steps, batch, H, outer_step) -> None:
    """Each node's inner steps on its own shard; ``outer_step()`` every H steps and after the
    last one."""
    for s in range(steps):
        for r, (m, opt) in enumerate(zip(models, inner, strict=True)):
            opt.zero_grad()
            m(sharded_batch(data, r, len(models), s, batch)).backward()
            opt.step()
        if (s + 1) % H == 0 or s == steps - 1:
            outer_step()


def restart_from(models, theta) -> None:
    """Every node continues from the global parameters."""
    with torch.no_grad():
        for m in models:
            for p, t in zip(m.parameters(), theta, strict=True):
                p.copy_(t)


def reference_compressed_diloco(data, nodes, steps, batch, *, H, inner_lr, levels, block,
                                error_feedback) -> list[torch.Tensor]:
    """DiLoCo whose outer gradient each node quantises blockwise (absmax, ``levels``) over its
    parameters laid end to end; the nodes' dequantised deltas averaged in float32; with error
    feedback each node adds what its last payload lost to its next delta."""
    models = [MLP() for _ in range(nodes)]
    inner = [torch.optim.AdamW(m.parameters(), lr=inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
             for m in models]
    theta = [p.detach().clone().requires_grad_(True) for p in MLP().parameters()]
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
    lost = [torch.zeros(sum(t.numel() for t in theta)) for _ in range(nodes)]

    def outer_step() -> None:
        with torch.no_grad():
            carried = []
            for r, m in enumerate(models):
                delta = torch.cat([(t - p).reshape(-1) for t, p in zip(theta, m.parameters(),
                                                                        strict=True)])
                if error_feedback:
                    delta = delta + lost[r]
                q = reference_blockwise(delta, levels, block)
                lost[r] = delta - q
                carried.append(q)
            mean = sum(carried) / nodes
            offset = 0
            for t in theta:
                t.grad = mean[offset : offset + t.numel()].view_as(t).clone()
                offset += t.numel()
        outer.step()
        restart_from(models, theta)

    local_rounds(models, inner, data, steps, batch, H, outer_step)
    return [t.detach() for t in theta]


@pytest.mark.parametrize(("name", "levels"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_compressed_diloco_matches_the_reference(name, levels, error_feedback, tmp_path):
    nodes, steps, batch, H, block = 3, 7, 4, 3, 32
    data = regression_data(nodes * batch * steps)
    strategy = DiLoCo(H=H, lr=0.01, compression=name, compression_block=block,
                      error_feedback=error_feedback)
    result = fit(strategy, tmp_path, data, nodes=nodes, max_steps=steps, batch_size=batch)
    expected = reference_compressed_diloco(data, nodes, steps, batch, H=H, inner_lr=0.01,
                                           levels=levels, block=block, error_feedback=error_feedback)
    for p, e in zip(result.model.parameters(), expected, strict=True):
        assert_close(p.detach(), e, **TOL)
    if error_feedback:  # the residual changed the trajectory
        plain = reference_compressed_diloco(data, nodes, steps, batch, H=H, inner_lr=0.01,
                                            levels=levels, block=block, error_feedback=False)
        assert any(not torch.allclose(p.detach(), e, **TOL)
                   for p, e in zip(result.model.parameters(), plain, strict=True))


def comm_bytes(strategy, tmp_path, **kwargs):
    data = regression_data(64)
    result = fit(strategy, tmp_path, data, nodes=2, max_steps=4, batch_size=4, **kwargs)
    return result.summary["bytes_sent_per_node"], result.summary["bytes_received_per_node"]


def test_wire_bytes_are_exact_quarter_and_eighth_of_fp32_plus_scales(tmp_path):
    numel = sum(p.numel() for p in MLP().parameters())
    syncs, block = 2, 128
    fp32 = comm_bytes(DiLoCo(H=2), tmp_path / "fp32")
    assert fp32 == (syncs * 4 * numel, syncs * 4 * numel)  # 2 nodes: the ring moves S each way
    scales = 4 * math.ceil(numel / block)
    for name, payload in [("bf16", 2 * numel), ("fp16", 2 * numel),
                          ("int8", numel + scales), ("int4", math.ceil(numel / 2) + scales)]:
        sent = comm_bytes(DiLoCo(H=2, compression=name, compression_block=block), tmp_path / name)
        assert sent == (syncs * payload, syncs * payload), name


def test_fp32_compression_is_todays_all_reduce_bit_for_bit(tmp_path):
    data = regression_data(96)
    kwargs = dict(nodes=3, max_steps=6, batch_size=4)
    plain = fit(DiLoCo(H=3, lr=0.01), tmp_path / "a", data, **kwargs)
    fp32 = fit(DiLoCo(H=3, lr=0.01, compression="fp32", error_feedback=True), tmp_path / "b",
               data, **kwargs)
    for a, b in zip(plain.model.parameters(), fp32.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert plain.summary["bytes_sent_per_node"] == fp32.summary["bytes_sent_per_node"]


def test_compressed_diloco_is_identical_on_threads_and_vmap(tmp_path):
    data = regression_data(96)
    kwargs = dict(nodes=2, max_steps=6, batch_size=4)
    threads = fit(DiLoCo(H=3, lr=0.01, compression="int8", error_feedback=True), tmp_path / "t",
                  data, **kwargs)
    vmapped = fit(DiLoCo(H=3, lr=0.01, compression="int8", error_feedback=True), tmp_path / "v",
                  data, runtime="vmap", **kwargs)
    for a, b in zip(threads.model.parameters(), vmapped.model.parameters(), strict=True):
        assert_close(a, b, **TOL)
    assert threads.summary["bytes_sent_per_node"] == vmapped.summary["bytes_sent_per_node"]


def test_sparta_diloco_and_fedavg_take_compression(tmp_path):
    numel = sum(p.numel() for p in MLP().parameters())
    payload = numel + 4 * math.ceil(numel / 128)
    fed = comm_bytes(FedAvg(H=2, compression="int8"), tmp_path / "fed")
    assert fed == (2 * payload, 2 * payload)
    sparta = SPARTADiLoCo(p=0.5, H=2, compression="int8")
    assert sparta.modules[1].compression is not None


def test_compressed_fedavg_averages_round_deltas(tmp_path):
    """FedAvg with int8: theta = anchor - mean_i Q(anchor - theta_i): with H=1, SGD, plain
    torch, two nodes, one round by hand."""
    nodes, batch = 2, 4
    data = regression_data(nodes * batch)
    result = fit(FedAvg(H=1, lr=0.1, compression="int8", compression_block=16), tmp_path, data,
                 nodes=nodes, max_steps=1, batch_size=batch)
    start = [p.detach().clone() for p in MLP().parameters()]
    deltas = []
    for r in range(nodes):
        m = MLP()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(sharded_batch(data, r, nodes, 0, batch)).backward()
        opt.step()
        flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(start, m.parameters(),
                                                                        strict=True)])
        deltas.append(reference_blockwise(flat, 127, 16))
    mean = (deltas[0] + deltas[1]) / 2
    offset = 0
    for p, a in zip(result.model.parameters(), start, strict=True):
        assert_close(p.detach(), a - mean[offset : offset + a.numel()].view_as(a), **TOL)
        offset += a.numel()


def test_compression_refusals_are_one_line():
    with pytest.raises(ValueError, match="does not combine with island_size"):
        FedAvg(H=2, island_size=2, compression="int8")
    with pytest.raises(ValueError, match="compression must be one of"):
        DiLoCo(compression="int2")


def test_compression_setting_reaches_every_pseudo_gradient_strategy():
    for name in ("diloco", "sparta-diloco", "fedavg"):
        params = STRATEGIES[name].parameters()
        assert params["compression"].default == "fp32", name
        assert {"compression_block", "error_feedback"} <= set(params), name


def test_set_compression_on_the_command_line_is_checked(tmp_path):
    from meshtrain.config.spec import RunSpec
    from meshtrain.config.strategy_options import build_strategy

    built = build_strategy(RunSpec(strategy="diloco", strategy_options={"compression": "int4"}))
    assert built.modules[0].compression is not None
    with pytest.raises(ConfigError, match="strategy 'diloco': compression must be one of"):
        build_strategy(RunSpec(strategy="diloco", strategy_options={"compression": "int3"}))


# ------------------------------------------------------------------------------ SparseLoCo
def reference_sparseloco(data, nodes, steps, batch, *, H, inner_lr, outer_lr, decay, chunk, k):
    """SparseLoCo (arXiv 2508.15706, Algorithm 1) on ``nodes`` nodes, plain torch: inner AdamW
    from theta; every H steps (and after the last) each node r: delta_r = theta - theta_r,
    e_r = decay * e_r + delta_r, q_r = Q(TopK(e_r)), e_r -= q_r; theta -= outer_lr * mean_r q_r."""
    models = [MLP() for _ in range(nodes)]
    inner = [torch.optim.AdamW(m.parameters(), lr=inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
             for m in models]
    theta = [p.detach().clone() for p in MLP().parameters()]
    numel = sum(t.numel() for t in theta)
    errors = [torch.zeros(numel) for _ in range(nodes)]

    def outer_step() -> None:
        with torch.no_grad():
            sent = []
            for r, m in enumerate(models):
                delta = torch.cat([(t - p).reshape(-1) for t, p in zip(theta, m.parameters(),
                                                                        strict=True)])
                errors[r] = decay * errors[r] + delta
                q = reference_sparse(errors[r], chunk, k)
                errors[r] = errors[r] - q
                sent.append(q)
            mean = sum(sent) / nodes
            offset = 0
            for t in theta:
                t -= outer_lr * mean[offset : offset + t.numel()].view_as(t)
                offset += t.numel()
        restart_from(models, theta)

    local_rounds(models, inner, data, steps, batch, H, outer_step)
    return theta


def test_sparseloco_matches_the_reference(tmp_path):
    nodes, steps, batch, H, chunk, k = 2, 7, 4, 3, 64, 8
    data = regression_data(nodes * batch * steps)
    strategy = SparseLoCo(H=H, lr=0.01, chunk=chunk, topk=k)
    result = fit(strategy, tmp_path, data, nodes=nodes, max_steps=steps, batch_size=batch)
    expected = reference_sparseloco(data, nodes, steps, batch, H=H, inner_lr=0.01, outer_lr=1.0,
                                    decay=0.95, chunk=chunk, k=k)
    for p, e in zip(result.model.parameters(), expected, strict=True):
        assert_close(p.detach(), e, **TOL)
    # the decay matters: without it (beta = 1) the trajectory differs
    undecayed = reference_sparseloco(data, nodes, steps, batch, H=H, inner_lr=0.01, outer_lr=1.0,
                                     decay=1.0, chunk=chunk, k=k)
    assert any(not torch.allclose(p.detach(), e, **TOL)
               for p, e in zip(result.model.parameters(), undecayed, strict=True))


def test_sparseloco_defaults_and_exact_bytes(tmp_path):
    s = SparseLoCo()
    assert (s.H, s.outer_lr, s.topk, s.chunk, s.decay) == (30, 1.0, 64, 4096, 0.95)
    numel = sum(p.numel() for p in MLP().parameters())
    sent = comm_bytes(SparseLoCo(H=2), tmp_path)
    per_sync = math.ceil(numel / 4096) * 116
    assert sent == (2 * per_sync, 2 * per_sync)


def test_sparseloco_is_identical_on_threads_and_vmap(tmp_path):
    data = regression_data(96)
    kwargs = dict(nodes=2, max_steps=6, batch_size=4)
    threads = fit(SparseLoCo(H=3, lr=0.01, chunk=64, topk=8), tmp_path / "t", data, **kwargs)
    vmapped = fit(SparseLoCo(H=3, lr=0.01, chunk=64, topk=8), tmp_path / "v", data,
                  runtime="vmap", **kwargs)
    for a, b in zip(threads.model.parameters(), vmapped.model.parameters(), strict=True):
        assert_close(a, b, **TOL)


def test_set_compression_and_sparseloco_from_the_cli(tmp_path):
    from typer.testing import CliRunner

    from meshtrain.cli.main import app

    runner = CliRunner()
    for strategy, extra in (("diloco", ["--set", "compression=int8", "--set", "H=2"]),
                            ("sparseloco", ["--set", "H=2"])):
        out = tmp_path / strategy
        result = runner.invoke(app, ["simulate", "--strategy", strategy, "--steps", "4", "--nodes", "2",
                                     "--no-progress", "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        (summary,) = out.glob("*/summary.json")
        assert json.loads(summary.read_text())["bytes_sent_per_node"] > 0


def test_compare_takes_sparseloco_and_compressed_diloco():
    from meshtrain.compare import CompareSpec, plan

    planned = plan(CompareSpec(strategies=["diloco", "sparseloco"],
                               overrides=["diloco.compression=int8", "sparseloco.H=10"]))
    options = {p.strategy: p.instance.config() for p in planned}
    assert options["diloco"]["compression"] == "int8"
    assert options["sparseloco"]["H"] == 10 and options["sparseloco"]["topk"] == 64


def test_compressed_weighted_fedavg_weights_each_nodes_payload_by_its_samples(tmp_path):
    """weighted=True: theta = anchor - sum_i n_i Q(delta_i) / sum_i n_i, n_i riding as 4 bytes."""
    from helpers import unequal_factory

    nodes, batch = 2, 4
    strategy = FedAvg(H=1, lr=0.1, weighted=True, compression="int8", compression_block=16)
    result = Trainer(MLP(), unequal_factory).fit(strategy, nodes=nodes, max_steps=1, batch_size=batch,
                                                 out_dir=tmp_path, progress=False, shuffle=False)
    start = [p.detach().clone() for p in MLP().parameters()]
    numel = sum(p.numel() for p in start)
    total, weights = torch.zeros(numel), 0.0
    for r in range(nodes):
        data = unequal_factory(r, nodes, "train")
        m = MLP()
        m(tuple(t[:batch] for t in data.tensors)).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(start, m.parameters(),
                                                                        strict=True)])
        total += len(data) * reference_blockwise(flat, 127, 16)
        weights += len(data)
    mean = total / weights
    offset = 0
    for p, a in zip(result.model.parameters(), start, strict=True):
        assert_close(p.detach(), a - mean[offset : offset + a.numel()].view_as(a), **TOL)
        offset += a.numel()
    payload = numel + 4 * math.ceil(numel / 16) + 4
    assert result.summary["bytes_sent_per_node"] == payload


def test_streaming_diloco_sends_each_fragment_compressed(tmp_path):
    """compression applies to streaming DiLoCo per fragment: every fragment sync of an int8 run
    sends the int8 payload of the fragment its fp32 twin sends in full (2 nodes: 4n bytes)."""
    from meshtrain.strategies.streaming_diloco import StreamingDiLoCo

    data = regression_data(96)
    kwargs = dict(nodes=2, max_steps=8, batch_size=4)
    runs = {name: fit(StreamingDiLoCo(fragments=2, H=4, tau=1, lr=0.01, compression=name),
                      tmp_path / name, data, **kwargs) for name in ("fp32", "int8")}
    sent = {name: {r["step"]: r["bytes_sent"] for r in run.history if r.get("bytes_sent")}
            for name, run in runs.items()}
    last = max(sent["fp32"])  # the final syncs of every fragment share the last step
    syncs = [(step, b) for step, b in sent["fp32"].items() if step != last]
    assert len(syncs) >= 2
    for step, fp32_bytes in syncs:
        numel = fp32_bytes // 4
        assert sent["int8"][step] == numel + 4 * math.ceil(numel / 128), step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("codec", [Codec("int8"), Codec("int4"), Codec("bf16"), SparseCodec(4096, 64)])
def test_codecs_on_cuda_put_the_cpu_bytes_on_the_wire(codec):
    x = torch.randn(2, 10_000, generator=torch.Generator().manual_seed(5))
    on_cpu = codec.encode(x)
    on_gpu = codec.encode(x.cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(codec.decode(on_gpu[0], 10_000).cpu(), codec.decode(on_cpu[0], 10_000))
