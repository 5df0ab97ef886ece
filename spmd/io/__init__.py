"""What goes in and out of a run: checkpoints, Hugging Face weights, inference, the lm-eval adapter."""
