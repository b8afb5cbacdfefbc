"""kvflow-ray: workflow-aware KV cache management for LLM multi-agent workflows."""

__version__ = "0.1.0"
