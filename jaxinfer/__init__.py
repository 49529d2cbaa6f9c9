"""jaxinfer: a JAX/XLA research framework for LLM inference."""

__version__ = "0.1.0"
