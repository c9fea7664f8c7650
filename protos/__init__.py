"""The contracts between services: protobuf messages, gRPC services and their helpers.

Regenerate the Python code with `python -m protos.generate` after editing a `.proto` file.
"""
