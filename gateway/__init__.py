"""The OpenAI-compatible gateway: agent programs' chat calls in, token-exact trajectories out."""
