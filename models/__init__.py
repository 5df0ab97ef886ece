"""Transformer model families in Flax NNX (spmd.models): each family a folder with its FAMILY
(spmd.core.family), the layers and decoder they share beside them. Parameters carry logical axis
names; no mesh code here."""
