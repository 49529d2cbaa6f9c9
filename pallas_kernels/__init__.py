"""Standalone Pallas GPU kernels, each with a pure-JAX reference. Importable without jaxinfer."""
