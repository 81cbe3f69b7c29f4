"""DDP vs DiLoCo vs SPARTA on scikit-learn's digits, with the comparison plots.

The library side of `meshtrain compare`: every strategy trains the same MLP from the same
initial weights on the same data order for the same number of steps; the comparison
folder gets one run directory per strategy, comparison.json/.csv and the plots
(val loss against steps, bytes sent per node, and projected time on the cluster).

    python examples/compare_digits.py                     # 300 steps, about 20 s on a laptop
    python examples/compare_digits.py --steps 100 --cluster wifi --out /tmp/runs
"""

from __future__ import annotations

import argparse

from meshtrain.compare import CompareSpec, Comparison, run_comparison


def main(argv: list[str] | None = None) -> Comparison:
    """Run the comparison and print one line per strategy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--cluster", default="gbe", help="named cluster or cluster file")
    parser.add_argument("--out", default="runs")
    args = parser.parse_args(argv)
    spec = CompareSpec(
        strategies=["ddp", "diloco", "sparta"],
        settings={"nodes": args.nodes, "task": "digits", "steps": args.steps, "cluster": args.cluster,
                  "out_dir": args.out, "progress": False},
        # Validate 6 times whatever the budget, so the curves have points to draw.
        overrides=[f"val_interval={max(1, args.steps // 6)}", "diloco.H=25", "sparta.p=0.005"],
    )
    result = run_comparison(spec, notify=print)
    for row in result.rows:
        ratio = "the baseline" if row["strategy"] == "ddp" else \
            f"{row['ddp_bytes_per_this']:.0f}x fewer than DDP"
        print(f"{row['label']:<16} val loss {row['final_val_loss']:.4f}  "
              f"accuracy {row['final_metric']:.3f}  sent {row['bytes_sent_per_node'] / 1e6:7.3f} MB "
              f"per node ({ratio})  projected {row['projected_seconds']:.2f} s "
              f"on {row['cluster']}")
    print(f"target {result.target_loss:.4f} ({result.target_rule}); plots and tables in {result.folder}")
    return result


if __name__ == "__main__":
    main()
