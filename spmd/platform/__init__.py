"""The process and the host: CPU matmul library, host heap, jax.distributed, the local launcher."""
