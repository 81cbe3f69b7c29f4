"""FedAvg on 16 nodes that average in islands of 4 instead of all together.

Each node trains H local steps, then the nodes are split into random islands of 4 (a
seeded shuffle every node computes the same way, so nothing is sent to agree on it) and
average parameters within their island only. A ring all-reduce over g nodes sends
2(g-1)/g of the model per node, so islands of 4 send 1.5x the model per sync where all
16 together send 1.875x, and no message ever waits on more than 3 other nodes. The run
ends with one average over all 16, so that there is one global model to save.

    python examples/federated_islands.py                  # 16 nodes, H=10, islands of 4
    python examples/federated_islands.py --steps 400 --H 20
"""

from __future__ import annotations

import argparse

from meshtrain import Trainer
from meshtrain.strategies import FedAvg
from meshtrain.tasks import TaskOptions
from meshtrain.tasks.digits import TASK


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Train FedAvg with islands of 4 and with all 16 together; returns both summaries."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--island-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--H", type=int, default=10)
    parser.add_argument("--cluster", default="wifi")
    parser.add_argument("--out", default="runs")
    args = parser.parse_args(argv)

    summaries = {}
    for name, island_size in (("islands", args.island_size), ("everyone", None)):
        digits = TASK.build(TaskOptions(seed=0, options=TASK.options))  # the same start for both
        result = Trainer(digits.model, digits.train_data, digits.val_data).fit(
            strategy=FedAvg(H=args.H, island_size=island_size, lr=0.1), nodes=args.nodes,
            max_steps=args.steps, batch_size=16, val_interval=max(1, args.steps // 4),
            cluster=args.cluster, out_dir=args.out, progress=False)
        s = summaries[name] = result.summary
        groups = f"islands of {island_size}" if island_size else f"all {args.nodes} together"
        print(f"FedAvg H={args.H}, {groups:<16} val loss {s['final_val_loss']:.4f}  accuracy "
              f"{s['final_accuracy']:.3f}  sent {s['bytes_sent_per_node'] / 1e6:.3f} MB per node  "
              f"projected {s['projected']['total_seconds']:.2f} s on {s['projected']['cluster']}")
    return summaries


if __name__ == "__main__":
    main()
