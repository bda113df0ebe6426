"""Where time and memory go: profiles, kernels, one-off measurements."""
