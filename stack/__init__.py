"""The roof: the stack-level config, CLI, local launcher and demo; may import every service.

Everything else in `searchr1/` is the floor (plumbing every service uses) and imports no
service and nothing from here.
"""
