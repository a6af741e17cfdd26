"""Lean forward passes for decoding: a static-cache decoder for declared model families."""
