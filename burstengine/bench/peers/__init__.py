"""Benches that time BurstEngine beside its peers (same devices, same launch), and the peers themselves."""
