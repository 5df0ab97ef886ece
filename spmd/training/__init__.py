"""The train state and its jitted steps: trainer, optimizer, loss, model transforms (LoRA)."""
