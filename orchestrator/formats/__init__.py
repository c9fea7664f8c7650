"""Action formats: how a model message becomes what the loop appends next, one module each.

- `search_r1.py`: Search-R1's tags (`<search>`/`<answer>`, results in `<information>`); one
  tool, search.
- `function_calling.py`: the chat template's `<tool_call>` over any tools (`rollout.tools`),
  results as the template's `tool` turns.
- `environment.py`: a task whose environment answers every message (orchestrator/tasks/).

`base.py` says what the rollout loop asks of a format (`TurnFormat`) and what a format may use
of the loop (`TurnHost`); `orchestrator.rollout.Rollout` picks one and runs it.
"""
