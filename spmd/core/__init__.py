"""The core: meshes, sharding rules and presets, logical axis names, the model-family contract, errors."""
