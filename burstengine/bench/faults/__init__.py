"""Lost ranks at every phase of a job, how fast they are named, damaged files, and long runs (soak)."""
