"""Parallelism: the sharding plan and one module per strategy (data, FSDP, tensor, context, expert, pipeline), memory kinds."""
