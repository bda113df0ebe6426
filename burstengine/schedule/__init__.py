"""The schedule: pure functions of shared arguments (layout, mask, world, local length) that say
which blocks meet at each ring step (blocks.py), in which order shards travel (order.py) and
what each hop carries (traffic.py).  No torch.distributed, no attention runtime."""
from .blocks import (Segment, Task, attention_flops, block_tasks, forward_schedule, run_steps, segments, step_work,
                     visible_pairs)
from .order import DoubleStep, Topology, double_ring_steps, hop_peers, link_hops, node_blocks, ring_source
from .traffic import (SIDES, backward_by_bytes, backward_bytes, forward_bytes, home_bytes, hop_bytes, partial_rows,
                      read_rows, sent_rows, travel_rows)

__all__ = ["Segment", "Task", "attention_flops", "block_tasks", "forward_schedule", "run_steps", "segments",
           "step_work", "visible_pairs", "DoubleStep", "Topology", "double_ring_steps", "hop_peers", "link_hops",
           "node_blocks", "ring_source", "SIDES", "backward_by_bytes", "backward_bytes", "forward_bytes", "hop_bytes",
           "home_bytes", "partial_rows", "read_rows", "sent_rows", "travel_rows"]
