"""Protocol-true mock vLLM engines whose timing and cache come from the simulator's engine model."""
