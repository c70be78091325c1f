"""Engines: what a rank computes with. The training engine (FSDP2-sharded causal LM with its
optimizer) and the rollout engines (transformers, vLLM) behind one interface."""
