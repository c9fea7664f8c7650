"""Tools the policy calls during a rollout: the interface, the runner that gives every tool the
same guarantees, the built-ins, MCP servers' tools, and the action formats (docs/orchestrator.md,
"Tools")."""
