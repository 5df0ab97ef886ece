"""The train state and its jitted steps: trainer, optimizer, loss, the seam of model transforms (what trains, what is frozen)."""
