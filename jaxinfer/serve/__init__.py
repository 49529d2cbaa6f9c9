"""An OpenAI-compatible HTTP server over the engine (`jaxinfer serve`) and an online benchmark
client for any such server (`jaxinfer bench serve`). docs/serving.md has the design."""
