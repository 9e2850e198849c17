"""The rollout engine: the policy's own weights, a KV cache kept across turns, continuous batching."""
