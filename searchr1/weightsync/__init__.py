"""Live weight updates from a trainer to inference engines, one package for both sides.

`protocol` (the HTTP contract of the weight routes both engines answer, and the engine calls
the sender drives), `group` (the process group the tensors are broadcast over), `sender` (the
trainer side, `WeightSender`) and `receiver` (our reference engine's side, `WeightLoader`).
"""
