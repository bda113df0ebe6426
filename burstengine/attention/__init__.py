from .burst import backward_bytes, burst_attn_func, choose_backward, forward_bytes
from .schedule import Pattern, Task, attention_flops, block_tasks, forward_schedule, ring_steps, step_work, visible_pairs

__all__ = ["burst_attn_func", "backward_bytes", "forward_bytes", "choose_backward", "Task", "block_tasks",
           "forward_schedule", "step_work", "Pattern", "ring_steps", "attention_flops", "visible_pairs"]
