"""Multi-turn search rollouts, rewards, and the trajectory stream into Redis."""
