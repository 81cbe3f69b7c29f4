"""A custom strategy in about ten lines: DDP with gradients sent as signed int8.

Every node scales its gradient by one shared scale (the largest magnitude on any
node: one tiny all-reduce with max), rounds it to int8 in [-127, 127], and the int8
vectors are all-gathered and averaged. Each value travels in 1 byte instead of 4;
as an all-gather (not a ring all-reduce) that halves DDP's traffic on 4 nodes.

    python examples/custom_strategy.py
"""

from __future__ import annotations

import torch

from meshtrain.strategies import Strategy


class Int8DDP(Strategy):
    """DDP with int8-quantised gradients (one shared scale, signed values)."""

    name = "int8-ddp"
    replicas_in_sync = True  # every node decodes the same gathered data

    def before_optimizer_step(self, step: int) -> None:
        grads = self.grads()  # zeros where a parameter got no gradient; grad_flags says which
        flat = torch.cat([g.reshape(-1) for g in grads])
        shared = torch.cat([flat.abs().max().reshape(1).clamp(min=1e-12), self.grad_flags])
        self.comm.all_reduce(shared, op="max")  # the largest scale, and who had gradients
        scale = shared[:1]
        quantised = torch.round(flat / scale * 127).to(torch.int8)
        gathered = self.comm.all_gather(quantised)  # one per node taking part
        total = torch.stack(gathered).to(torch.int32).sum(0)
        mean = total.to(flat.dtype) * (scale / 127 / len(gathered))
        for g, piece in zip(grads, mean.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))
        self.release_unused_grads(shared[1:])  # no gradient anywhere: leave it untouched


if __name__ == "__main__":
    from meshtrain import Trainer
    from meshtrain.tasks import TaskOptions
    from meshtrain.tasks.digits import TASK

    digits = TASK.build(TaskOptions(options=TASK.options))
    result = Trainer(digits.model, digits.train_data, digits.val_data).fit(
        strategy=Int8DDP(optim="adamw", lr=2e-3), nodes=4, max_steps=300, batch_size=32
    )
    print(f"val loss {result.summary['final_val_loss']:.4f}, "
          f"accuracy {result.summary['final_accuracy']:.3f}, "
          f"sent {result.summary['bytes_sent_per_node'] / 1e6:.2f} MB per node -> {result.run_dir}")
