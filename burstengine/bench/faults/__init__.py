"""Lost ranks at every phase of a job, how fast they are named, and long runs (soak)."""
