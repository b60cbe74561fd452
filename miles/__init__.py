"""Miles: Hydra-configured RL post-training for LLMs (see README.md and docs/)."""
