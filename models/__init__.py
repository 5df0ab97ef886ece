"""Transformer models in Flax NNX. Parameters carry logical axis names; no mesh code here."""
