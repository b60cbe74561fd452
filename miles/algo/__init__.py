"""RL math as pure tensor functions: advantages, policy losses, KL estimators (selected by name)."""
