"""pagedserve: a PagedAttention LLM server whose KV cache is a service of its own."""

__version__ = "0.1.0"
