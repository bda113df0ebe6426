from .burst import backward_bytes, burst_attn_func, choose_backward, forward_bytes, hop_bytes
from .hybrid import hybrid_attn_func
from .schedule import (Pattern, Task, attention_flops, block_tasks, forward_schedule, partial_rows, ring_source, ring_steps,
                       sent_rows, step_work, travel_rows, visible_pairs)

__all__ = ["burst_attn_func", "hybrid_attn_func", "backward_bytes", "forward_bytes", "hop_bytes", "choose_backward",
           "Task", "block_tasks", "forward_schedule", "ring_source", "step_work", "Pattern", "ring_steps",
           "attention_flops", "visible_pairs", "travel_rows", "partial_rows", "sent_rows"]
