"""Sizing a run without running it: compiled memory and collectives (AOT), the HLO reader, TPU topologies, hardware figures, out-of-memory checks."""
