"""SPMD training stack: meshes, sharding rules, training loop, data and metrics."""
