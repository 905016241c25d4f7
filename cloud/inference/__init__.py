"""The engine: batched passes over every live stream's segments, its scheduler, the commit policy, the vLLM decoder."""
