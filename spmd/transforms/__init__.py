"""Model transforms (spmd.training.transform): each module here that defines `TRANSFORM` is one,
found by the config table it owns."""
