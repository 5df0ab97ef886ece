"""The console scripts, one module each; shared plumbing in `common`."""
