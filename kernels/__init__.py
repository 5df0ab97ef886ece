"""Attention kernels: Pallas flash attention and pure-JAX chunked attention, each with a reference."""
