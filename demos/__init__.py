"""The demos: `searchr1 demo` and its worlds, warm starts and runners, one per task.

They sit above the stack's roof (`stack/`: the CLI, the config, the launcher): a demo builds
its world and its warm-started model, then trains through `stack.launcher.run_local` like any
run. The CLI reaches them by dotted path only (`stack.cli.COMMANDS["demo"]`), so no folder
arrow runs from the roof to them.
"""
